"""What KV events cost (issue 31): the same traffic against a sidecar with `--kv-events`
(and a subscriber draining it) and one without, interleaved, in one run.

    python -m loadtest.micro.events [--pairs 4] [--rounds 7] [--n 300] [--page-kib 192]
                                    [--pool-pages 2048] [--gather 0.02] [--buffer-mib 32]
                                    [--no-fill] [--control] [--json]

    exists 1,000 keys (500 present)      no event: the cost of the hooks being there
    set 64 x 192 KiB, new keys each      64 BlockStored a request, and BlockRemoved as the
      time                               host pool (2,048 pages) evicts (with tokens and a
                                         parent)

Pages of 192 KiB by default: a 16-token page of the smallest model an engine here would
serve (Qwen2.5-0.5B, 12 KiB of KV a token; Llama-3-8B's is 2 MiB). `--page-kib 4
--pool-pages 8192 --n 600` is the stress: pages with no bytes to speak of, the event
work against nothing but the set's bookkeeping (docs/kv-events.md, Cost).

Each figure: req/s and server CPU per request (every thread's, from schedstat: in
nanoseconds, not 10 ms ticks), medians of the rounds, and the ratio on / off (target >=
0.95x): the median of the rounds' ratios, each round's two sidecars run back to back.
Rounds go to `--pairs` pairs of sidecars, each pair fresh processes: two processes of
the same code differ by a few per cent on this kind of machine (memory layout, which core),
and one pair would take that for the cost of events. `--control` runs the same pairs with
events off on both sides too: the ratio two equal sidecars show, the run's noise floor.

Steady state: before its rounds, a pair takes sets until the evented sidecar's replay ring
is full and dropping its oldest batches (`/v1/stats` events: published > replay_batches),
its twin the same sets: a sidecar runs for days, its ring full. The ring is `--buffer-mib`
(the sidecar's --kv-events-buffer-bytes; 32 MiB fills in some 3,500 sets, the default 256
MiB in 28,000). `--no-fill` measures fresh sidecars instead.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import orjson

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.procs import free_port, start_sidecar
from loadtest.micro.bench import _connect, _read_response, div, exists_keys, task_cpu_seconds

TARGET = 0.95
PAGES = 64  # a set's pages
PAGE_KIB = 192  # a page (the stress: 4)
POOL_PAGES = 2048  # the host pool, in pages: sets evict as they go


def drain(endpoint: str) -> subprocess.Popen:
    """A subscriber that takes every event (a PUB with no subscriber costs less), in a
    process of its own, as a router is: not a thread beside the client's (its GIL)."""
    code = (
        "import sys, zmq\ns = zmq.Context.instance().socket(zmq.SUB)\n"
        "s.setsockopt(zmq.SUBSCRIBE, b'')\ns.connect(sys.argv[1])\n"
        "while True:\n    s.recv_multipart()\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, endpoint])


def posts(url: str, path: str, bodies: list[bytes]) -> float:
    """Seconds for one POST of each body, in order, on one keep-alive connection."""
    reqs = [
        (
            f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(b)}\r\n\r\n"
        ).encode()
        + b
        for b in bodies
    ]
    with _connect(url) as sock:
        t = time.perf_counter()
        for req in reqs:
            sock.sendall(req)
            _read_response(sock)
        return time.perf_counter() - t


def set_bodies(bid: str, round_: int, n: int) -> list[bytes]:
    out = []
    for r in range(n):
        base = (round_ * n + r) * PAGES
        keys = [f"{base + i:064x}" for i in range(PAGES)]
        out.append(
            orjson.dumps(
                {
                    "keys": keys,
                    "buffer_id": bid,
                    "slots": list(range(PAGES)),
                    "parent": f"{base - 1:064x}" if base else None,
                    "tokens": [[16 * (base + i) + t for t in range(16)] for i in range(PAGES)],
                }
            )
        )
    return out


def setup(sidecar, page: int = PAGE_KIB << 10) -> tuple[str, bytes, tuple]:
    """(buffer id, the exists body, what must stay alive: the client lent the buffer)."""
    c = SidecarClient(sidecar.socket_url)
    c.put_namespace("ev", page, key_format="vllm", page_tokens=16)
    buf = SharedBuffer(PAGES * page)
    bid = buf.register(c, "ev", PAGES, page_first_chunks(page))
    exists = orjson.dumps({"keys": exists_keys(sidecar.socket_url, "ev-exists")})
    return bid, exists, (c, buf)


def one(sidecar, bid: str, exists: bytes, r: int, n: int) -> dict:
    """(req/s, CPU s a request) of exists and of set, one round on one sidecar."""
    out = {}
    for what, path, bodies in (
        ("exists", "/v1/namespaces/ev-exists/exists", [exists] * n),
        ("set", "/v1/namespaces/ev/set", set_bodies(bid, r, n)),
    ):
        cpu = task_cpu_seconds(sidecar.proc.pid)
        secs = posts(sidecar.socket_url, path, bodies)
        out[what] = (n / secs, (task_cpu_seconds(sidecar.proc.pid) - cpu) / n)
    return out


def fill(on, off, setups: dict, n: int, ring: bool) -> int:
    """Sets to both sidecars of a pair, `n` at a time, until `on`'s replay ring has dropped
    a batch (`ring`; else one round); the rounds' keys are not these. Sets sent to each."""
    sent = 0
    while True:
        for name, proc in (("on", on), ("off", off)):
            posts(
                proc.socket_url,
                "/v1/namespaces/ev/set",
                set_bodies(setups[name][0], 10_000 + sent // n, n),
            )
        sent += n
        events = SidecarClient(on.url).stats().get("events", {})
        if not ring or events.get("published", 0) > events.get("replay_batches", 0):
            return sent


def pair(
    rows: dict,
    rounds: int,
    n: int,
    page: int,
    gather: float | None,
    slots: int = POOL_PAGES,
    on_first: bool = True,
    ring: int | None = 32 << 20,
) -> None:
    """One pair of fresh sidecars, `rounds` rounds each, alternating which goes first;
    each round's figures appended to `rows`. `gather` None: the control, "on" without
    events too (what two equal sidecars differ by). `on_first`: which one starts first
    (the first started ran some 3% slower in a control run here: pairs alternate it).
    `ring`: the evented one's replay ring in bytes, filled before the rounds; None: fresh."""
    port, pool = free_port(), f"{slots * page >> 10}KiB"
    evented = (
        ()
        if gather is None
        else (
            "--kv-events",
            f"tcp://127.0.0.1:{port}",
            "--kv-events-replay",
            f"tcp://127.0.0.1:{free_port()}",
            "--kv-events-gather",
            str(gather),  # (the replay port: port + 1 may be another's)
            "--kv-events-buffer-bytes",
            str(ring or 256 << 20),
            "--kv-events-token-ids",
        )
    )  # the most a set's events carry (off by default)
    flags = {"on": evented, "off": ()}
    started = {
        name: start_sidecar("--host-pool", pool, "--no-file-tier", *flags[name])
        for name in (("on", "off") if on_first else ("off", "on"))
    }
    on, off = started["on"], started["off"]
    sub = drain(f"tcp://127.0.0.1:{port}")
    try:
        setups = {"on": setup(on, page), "off": setup(off, page)}
        if ring is not None:
            fill(on, off, setups, n, gather is not None)
        for r in range(rounds):
            for name, proc in (("on", on), ("off", off)) if r % 2 else (("off", off), ("on", on)):
                bid, exists, _ = setups[name]
                rows[name].append(one(proc, bid, exists, r, n))
    finally:
        sub.kill()
        sub.wait()
        on.stop()
        off.stop()


def run(
    rounds: int,
    n: int,
    page: int = PAGE_KIB << 10,
    pairs: int = 1,
    gather: float | None = 0.02,
    slots: int = POOL_PAGES,
    ring: int | None = 32 << 20,
) -> dict:
    """`page`: bytes a page; the host pool holds `slots` of them, so sets evict as they go.
    `ring`: see `pair`. Besides the medians of every round, the CPU ratio of each pair
    (`cpu_by_pair`)."""
    rows: dict = {"on": [], "off": []}
    for i in range(pairs):
        pair(rows, rounds, n, page, gather, slots, on_first=i % 2 == 0, ring=ring)
    med = statistics.median
    res = {}
    for what in ("exists", "set"):
        a, b = [x[what] for x in rows["on"]], [x[what] for x in rows["off"]]
        cpu = [div(y[1], x[1]) for x, y in zip(a, b, strict=True)]
        res[what] = {
            "on_rps": med(x[0] for x in a),
            "off_rps": med(x[0] for x in b),
            "on_cpu_us": med(x[1] for x in a) * 1e6,
            "off_cpu_us": med(x[1] for x in b) * 1e6,
            "rps_ratio": med(x[0] / y[0] for x, y in zip(a, b, strict=True)),
            "cpu_ratio": med(cpu),
            "cpu_by_pair": [med(cpu[i : i + rounds]) for i in range(0, len(cpu), rounds)],
        }
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--pairs",
        type=int,
        default=4,
        help="pairs of fresh sidecars (which starts first alternates)",
    )
    p.add_argument("--rounds", type=int, default=7, help="rounds a pair")
    p.add_argument("--n", type=int, default=300, help="sets a round")
    p.add_argument(
        "--page-kib", type=int, default=PAGE_KIB, help="page size (4 KiB: the bookkeeping alone)"
    )
    p.add_argument(
        "--gather", type=float, default=0.02, help="--kv-events-gather of the sidecar with events"
    )
    p.add_argument("--pool-pages", type=int, default=POOL_PAGES, help="host pool size in pages")
    p.add_argument(
        "--buffer-mib",
        type=int,
        default=32,
        help="the evented sidecar's replay ring (--kv-events-buffer-bytes), filled first",
    )
    p.add_argument(
        "--no-fill",
        action="store_true",
        help="fresh sidecars: no sets before the rounds (the ring then 256 MiB, empty)",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="also run the pairs with events off on both sides: the noise floor",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    ring = None if args.no_fill else args.buffer_mib << 20
    out = {
        "events": run(
            args.rounds, args.n, args.page_kib << 10, args.pairs, args.gather, args.pool_pages, ring
        )
    }
    if args.control:
        out["control"] = run(
            args.rounds, args.n, args.page_kib << 10, args.pairs, None, args.pool_pages, ring
        )
    for name, res in out.items():
        for what, r in res.items():
            print(
                f"{name} {what}: on {r['on_rps']:.0f} req/s, {r['on_cpu_us']:.0f} us CPU vs off "
                f"{r['off_rps']:.0f} req/s, {r['off_cpu_us']:.0f} us CPU -> req/s {r['rps_ratio']:.2f}x, "
                f"CPU {r['cpu_ratio']:.2f}x (pairs {' '.join(f'{x:.2f}' for x in r['cpu_by_pair'])}; "
                f"off CPU / on; target >= {TARGET}x)"
            )
    if args.json:
        print(orjson.dumps(out).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
