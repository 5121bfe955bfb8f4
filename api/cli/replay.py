"""`sidecar replay TRACE --url URL ...`: replay a Mooncake-format trace against a sidecar.

Each line is one request in time order; `hash_ids` are chained 512-token prefix-block ids,
one page each. Every request runs as an engine would: `exists`, `get` of the leading hit
pages, `set` of the rest, through one shm buffer, in a fresh namespace whose host-pool
share is `--capacity-pages` pages. Beside it runs `LruSim`, the exact offline LRU model of
the same capacity: against a sidecar started with `--no-file-tier` the two hit rates agree.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from collections.abc import Iterator

import orjson

from api.cli.lru_sim import LruSim
from api.cli.progress import Progress
from api.cli.stats import pct
from api.engine.client import SidecarClient

BLOCK_TOKENS = 512


def read_trace(path: str, limit: int | None = None) -> Iterator[dict]:
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            if line.strip():
                yield orjson.loads(line)


class Replay:
    """One replay run: the sidecar side and the simulator side, request by request."""

    def __init__(self, client: SidecarClient, page_bytes: int, capacity_pages: int, max_pages: int):
        # here, not at the top: `sidecar serve` builds this module's parser, and the server
        # has no torch (api.engine.shm needs it: the `engine` extra)
        from api.engine.shm import SharedBuffer, page_first_chunks

        self.client, self.page_bytes = client, page_bytes
        self.ns = f"replay-{secrets.token_hex(4)}"
        client.put_namespace(
            self.ns,
            page_bytes,
            model="trace-replay",
            host_capacity_bytes=capacity_pages * page_bytes,
        )
        self.buf = SharedBuffer(max_pages * page_bytes)
        self.bid = self.buf.register(client, self.ns, max_pages, page_first_chunks(page_bytes))
        self.sim = LruSim(capacity_pages)
        self.lat: list[float] = []
        self.totals = dict(
            requests=0,
            pages=0,
            hit_pages=0,
            sim_hit_pages=0,
            tokens=0,
            hit_tokens=0,
            sim_hit_tokens=0,
            loaded=0,
            stored=0,
            failed_loads=0,
        )

    def run_one(self, req: dict) -> None:
        keys = [str(h) for h in req["hash_ids"]]
        tokens = int(req.get("input_length", len(keys) * BLOCK_TOKENS))
        t = time.perf_counter()
        hit = self.client.exists(self.ns, keys)
        if hit:
            loaded = self.client.get(self.ns, keys[:hit], self.bid, list(range(hit)))
            self.totals["loaded"] += sum(loaded)
            self.totals["failed_loads"] += hit - sum(loaded)
        if hit < len(keys):
            stored = self.client.set(self.ns, keys[hit:], self.bid, list(range(hit, len(keys))))
            self.totals["stored"] += sum(stored)
        self.lat.append(time.perf_counter() - t)
        sim_hit = self.sim.request(keys)
        tt = self.totals
        tt["requests"] += 1
        tt["pages"] += len(keys)
        tt["hit_pages"] += hit
        tt["sim_hit_pages"] += sim_hit
        tt["tokens"] += tokens
        tt["hit_tokens"] += min(hit * BLOCK_TOKENS, tokens)
        tt["sim_hit_tokens"] += min(sim_hit * BLOCK_TOKENS, tokens)

    def report(self, elapsed: float, stats: dict) -> dict:
        tt = self.totals
        moved = (tt["loaded"] + tt["stored"]) * self.page_bytes
        ns = stats["namespaces"][self.ns]
        return {
            "requests": tt["requests"],
            "pages": tt["pages"],
            "hit_rate_blocks": tt["hit_pages"] / max(tt["pages"], 1),
            "hit_rate_tokens": tt["hit_tokens"] / max(tt["tokens"], 1),
            "sim_hit_rate_blocks": tt["sim_hit_pages"] / max(tt["pages"], 1),
            "sim_hit_rate_tokens": tt["sim_hit_tokens"] / max(tt["tokens"], 1),
            "hits_from": {
                "host": tt["loaded"] - ns.get("tier_hits", 0),
                "tiers": ns.get("tier_hits", 0),
            },
            "failed_loads": tt["failed_loads"],
            "latency_ms": {
                "p50": pct(self.lat, 0.5) * 1e3,
                "p90": pct(self.lat, 0.9) * 1e3,
                "p99": pct(self.lat, 0.99) * 1e3,
                "mean": statistics.fmean(self.lat) * 1e3 if self.lat else 0.0,
            },
            "elapsed_s": elapsed,
            "req_per_s": tt["requests"] / elapsed if elapsed else 0.0,
            "gbps": moved / elapsed / 1e9 if elapsed else 0.0,
            "capacity_pages": self.sim.capacity,
            "page_bytes": self.page_bytes,
            "evictions": ns["evictions"],
            "sim_evictions": self.sim.evictions,
        }

    def close(self, keep: bool) -> None:
        if not keep:
            self.client.delete_namespace(self.ns)
        self.buf.close()


def run(args) -> dict:
    client = SidecarClient(args.url, token=args.token, timeout=60)
    trace = list(read_trace(args.trace, args.limit))
    max_pages = max((len(r["hash_ids"]) for r in trace), default=1)
    rep = Replay(client, args.page_bytes, args.capacity_pages, max(max_pages, 1))
    start = time.perf_counter()
    bar = Progress(len(trace), "replay")
    try:
        t0 = trace[0]["timestamp"] if trace else 0
        for req in trace:
            if args.speedup:
                due = (req["timestamp"] - t0) / 1000.0 / args.speedup  # trace timestamps are ms
                wait = due - (time.perf_counter() - start)
                if wait > 0:
                    time.sleep(wait)
            rep.run_one(req)
            bar.update()
        bar.close()
        elapsed = time.perf_counter() - start
        return rep.report(elapsed, client.stats())
    finally:
        rep.close(args.keep)


def parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(
        prog="sidecar replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="Mooncake-format JSONL trace")
    p.add_argument("--url", default="http://127.0.0.1:8411")
    p.add_argument("--token", default=None)
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--capacity-pages", type=int, required=True)
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--speedup",
        type=float,
        default=None,
        help="pace by the trace's timestamps, X times faster (default: no pacing)",
    )
    p.add_argument("--keep", action="store_true", help="keep the replay namespace afterwards")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    return p


def print_report(res: dict, as_json: bool) -> None:
    lat = res["latency_ms"]
    print(
        f"requests {res['requests']}  pages {res['pages']}  capacity {res['capacity_pages']} pages"
    )
    print(
        f"hit rate (blocks) {res['hit_rate_blocks']:.4f}   LRU simulation {res['sim_hit_rate_blocks']:.4f}"
    )
    print(
        f"hit rate (tokens) {res['hit_rate_tokens']:.4f}   LRU simulation {res['sim_hit_rate_tokens']:.4f}"
    )
    print(
        f"hits from: host {res['hits_from']['host']}, tiers {res['hits_from']['tiers']}; "
        f"evictions {res['evictions']} (simulation {res['sim_evictions']})"
    )
    print(
        f"latency per request ms: p50 {lat['p50']:.2f}  p90 {lat['p90']:.2f}  p99 {lat['p99']:.2f}; "
        f"{res['req_per_s']:.0f} req/s, {res['gbps']:.2f} GB/s"
    )
    if as_json:
        print(json.dumps(res))


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    print_report(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
