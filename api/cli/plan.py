"""`sidecar plan TRACE --capacities N1,N2,...`: how large a host pool (and file tier) does
this traffic need? The exact LRU simulation of `sidecar replay` (`LruSim`, no server),
swept over capacities:

    capacity (pages) -> hit rate (blocks, tokens), bytes = capacity x page bytes

`--file-pages N` adds the file tier as a second level (write-through, its own LRU of N pages;
a hit there is promoted into the host pool). `--engines N` adds the case the sidecar exists
for: the same total capacity split into N per-engine caches, requests round-robin, beside one
shared cache. Capacities are pages or percentages of the trace's unique pages (`10%`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from api.cli.lru_sim import LruSim
from api.cli.progress import Progress
from api.cli.replay import BLOCK_TOKENS, read_trace

# KV bytes per token of Qwen3-8B in bf16: 36 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes
DEFAULT_BYTES_PER_TOKEN = 36 * 8 * 128 * 2 * 2


class Request:
    __slots__ = ("keys", "tokens")

    def __init__(self, keys: list[str], tokens: int):
        self.keys, self.tokens = keys, tokens


def load(path: str, page_tokens: int, limit: int | None) -> list[Request]:
    """The trace's requests as page keys: each 512-token block is `512 / page_tokens` pages."""
    if page_tokens < 1 or BLOCK_TOKENS % page_tokens:
        raise ValueError(f"--page-tokens must divide the trace's block of {BLOCK_TOKENS} tokens")
    per_block = BLOCK_TOKENS // page_tokens
    out = []
    for req in read_trace(path, limit):
        ids = req["hash_ids"]
        keys = (
            [f"{h}.{j}" for h in ids for j in range(per_block)]
            if per_block > 1
            else list(map(str, ids))
        )
        out.append(Request(keys, int(req.get("input_length", len(ids) * BLOCK_TOKENS))))
    return out


class TwoLevel:
    """A host LRU in front of a file-tier LRU (write-through: every stored page reaches both)."""

    def __init__(self, host_pages: int, file_pages: int):
        self.host, self.file = LruSim(host_pages), LruSim(file_pages)

    def request(self, keys: Sequence[str]) -> int:
        host, files = self.host.lru, self.file.lru
        hit = 0
        for k in keys:
            if k not in host and k not in files:
                break
            hit += 1
        in_host = self.host.prefix(keys)
        self.host.get(keys[:in_host])
        self.file.get(keys[:hit])
        if in_host < hit:  # promoted from the file tier
            self.host.set(keys[in_host:hit])
        if hit < len(keys):
            self.host.set(keys[hit:])
            self.file.set(keys[hit:])
        return hit


def simulate(trace: list[Request], caches: list, page_tokens: int) -> dict:
    """Feed requests round-robin over `caches`; hit rate in blocks (pages) and tokens."""
    pages = hit_pages = tokens = hit_tokens = 0
    n = len(caches)
    for i, req in enumerate(trace):
        hit = caches[i % n].request(req.keys)
        pages += len(req.keys)
        hit_pages += hit
        tokens += req.tokens
        hit_tokens += min(hit * page_tokens, req.tokens)
    return {
        "hit_rate_blocks": hit_pages / max(pages, 1),
        "hit_rate_tokens": hit_tokens / max(tokens, 1),
    }


def unique_pages(trace: list[Request]) -> int:
    return len({k for r in trace for k in r.keys})


def parse_capacities(text: str, unique: int) -> list[int]:
    caps = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        n = round(unique * float(part[:-1]) / 100) if part.endswith("%") else int(part)
        if n < 1:
            raise ValueError(f"capacity {part!r} is under one page")
        caps.append(n)
    if not caps:
        raise ValueError("--capacities names no capacity")
    return sorted(set(caps))


def run(args) -> dict:
    trace = load(args.trace, args.page_tokens, args.limit)
    unique = unique_pages(trace)
    page_bytes = args.page_bytes or args.page_tokens * args.bytes_per_token
    caps = parse_capacities(args.capacities, unique)
    cost = node_cost(args)
    rows = []
    bar = Progress(len(caps), "plan")
    for cap in caps:
        row = {
            "capacity_pages": cap,
            "capacity_bytes": cap * page_bytes,
            "fraction_of_unique": cap / max(unique, 1),
            "node_bytes": round(
                cap * (page_bytes + cost["index_bytes_per_page"]) + cost["base_rss_bytes"]
            ),
            **simulate(trace, [LruSim(cap)], args.page_tokens),
        }
        if args.file_pages:
            two = simulate(trace, [TwoLevel(cap, args.file_pages)], args.page_tokens)
            row["with_file_tier"] = two
        if args.engines > 1:
            share = max(cap // args.engines, 1)
            row["per_engine"] = simulate(
                trace, [LruSim(share) for _ in range(args.engines)], args.page_tokens
            )
        rows.append(row)
        bar.update(1)
    bar.close()
    return {
        "trace": args.trace,
        "requests": len(trace),
        "unique_pages": unique,
        "page_tokens": args.page_tokens,
        "page_bytes": page_bytes,
        "engines": args.engines,
        "file_pages": args.file_pages,
        "cost": cost,
        "rows": rows,
    }


def node_cost(args) -> dict:
    """What a page costs beyond its bytes, and the process beyond its pages: read from a
    running sidecar's /v1/cost (`--cost-from URL`, its token from SIDECAR_TOKEN), else the
    index of a real page pool measured here (64-character keys) and no base."""
    if not args.cost_from:
        from sidecar.cost import index_bytes_per_page

        return {
            "index_bytes_per_page": round(index_bytes_per_page(), 1),
            "base_rss_bytes": 0,
            "source": "measured here: a page pool of 4,096 64-character keys",
        }
    from api.engine.client import SidecarClient, SidecarError

    c = SidecarClient(args.cost_from, token=os.environ.get("SIDECAR_TOKEN") or None, timeout=30)
    try:
        node = c.request("GET", "/v1/cost")[1]["node"]
    except SidecarError as exc:
        raise ValueError(f"--cost-from {args.cost_from}: {exc}") from exc
    finally:
        c.close()
    index = node["per_page"]["index_bytes"] or 0.0
    base = max(node["rss_bytes"] - node["nominal_bytes"] - node["index_bytes"], 0)
    return {
        "index_bytes_per_page": index,
        "base_rss_bytes": base,
        "source": f"{args.cost_from}/v1/cost ({node['pages']} pages)",
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def print_report(res: dict, as_json: bool) -> None:
    print(
        f"{res['requests']} requests, {res['unique_pages']} unique pages of "
        f"{res['page_tokens']} tokens, {human_bytes(res['page_bytes'])} each"
    )
    cost = res["cost"]
    print(
        f"node bytes = pages x (page + {cost['index_bytes_per_page']:.0f} B of index) + "
        f"{human_bytes(cost['base_rss_bytes'])} of process ({cost['source']})"
    )
    head = (
        f"{'capacity':>10} {'of unique':>9} {'bytes':>11} {'node bytes':>11} {'hit blocks':>10} "
        f"{'hit tokens':>10}"
    )
    if res["file_pages"]:
        head += f" {'+file tier':>10}"
    if res["engines"] > 1:
        head += f" {res['engines']:>3} engines  {'shared/per-engine':>17}"
    print(head)
    for r in res["rows"]:
        line = (
            f"{r['capacity_pages']:>10} {r['fraction_of_unique']:>9.1%} "
            f"{human_bytes(r['capacity_bytes']):>11} {human_bytes(r['node_bytes']):>11} "
            f"{r['hit_rate_blocks']:>10.4f} "
            f"{r['hit_rate_tokens']:>10.4f}"
        )
        if "with_file_tier" in r:
            line += f" {r['with_file_tier']['hit_rate_blocks']:>10.4f}"
        if "per_engine" in r:
            per = r["per_engine"]["hit_rate_blocks"]
            ratio = r["hit_rate_blocks"] / per if per else float("inf")
            line += f" {per:>11.4f}  {ratio:>16.1f}x"
        print(line)
    if as_json:
        print(json.dumps(res))


def plot(res: dict, path: str) -> None:
    """Hit rate against capacity, with the bytes each capacity costs on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np  # matplotlib's own dependency: the axis functions get arrays

    rows = res["rows"]
    x = [r["capacity_pages"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(x, [r["hit_rate_blocks"] for r in rows], "o-", label="shared sidecar (blocks)")
    ax.plot(x, [r["hit_rate_tokens"] for r in rows], "s--", label="shared sidecar (tokens)")
    if rows and "with_file_tier" in rows[0]:
        ax.plot(
            x,
            [r["with_file_tier"]["hit_rate_blocks"] for r in rows],
            "^-",
            label=f"+ file tier of {res['file_pages']} pages (blocks)",
        )
    if rows and "per_engine" in rows[0]:
        ax.plot(
            x,
            [r["per_engine"]["hit_rate_blocks"] for r in rows],
            "v-",
            label=f"{res['engines']} per-engine caches, same total (blocks)",
        )
    ax.set_xlabel("host pool capacity (pages)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    top = ax.secondary_xaxis(
        "top",
        functions=(
            lambda p: np.asarray(p) * res["page_bytes"] / 2**30,
            lambda g: np.asarray(g) * 2**30 / res["page_bytes"],
        ),
    )
    top.set_xlabel(f"GiB at {human_bytes(res['page_bytes'])} per page")
    ax.set_title(f"{res['requests']} requests, {res['unique_pages']} unique pages", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(
        prog="sidecar plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="Mooncake-format JSONL trace")
    p.add_argument(
        "--capacities",
        required=True,
        help="comma-separated host pool capacities: pages, or a percentage of unique pages",
    )
    p.add_argument(
        "--page-tokens",
        type=int,
        default=BLOCK_TOKENS,
        help=f"tokens per page (divides {BLOCK_TOKENS}, the trace's block; default {BLOCK_TOKENS})",
    )
    p.add_argument(
        "--bytes-per-token",
        type=int,
        default=DEFAULT_BYTES_PER_TOKEN,
        help="KV bytes per token (default: Qwen3-8B in bf16, 147456)",
    )
    p.add_argument(
        "--page-bytes", type=int, default=None, help="bytes per page (default: tokens x bytes)"
    )
    p.add_argument("--file-pages", type=int, default=0, help="add a file tier of this many pages")
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        help="also split each capacity into N per-engine caches (round-robin)",
    )
    p.add_argument(
        "--cost-from",
        default=None,
        help="URL of a running sidecar: its /v1/cost gives the index bytes a page "
        "and the process's base RSS for the 'node bytes' column",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--plot", default=None, help="write a hit rate vs capacity chart (PNG)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return cli(args)


def cli(args) -> int:
    try:
        res = run(args)
    except (ValueError, OSError) as exc:
        print(f"sidecar plan: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        plot(res, args.plot)
    print_report(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
