"""`make bench-3fs` (`python -m loadtest.micro.hf3fs`): the 3FS tier at cluster scale, the
slotted tier (sidecar/tiers/hf3fs_tier.py) against the file-per-page tier it replaced
(FileTier on the mount), in one run, loopback only.

    preload   --pages pages shared (default 1,000,000), written straight in each layout's
              on-disk format over --nodes node directories (the slotted one: each node's
              snapshot plus a log at the compaction threshold, the worst restart)
    nodes     --nodes tier instances, each in its own process, one directory standing in for
              the mount; each start is timed (restart-to-ready) and its RSS growth counted
    latency   a page set on node 1 -> `exists` (contains) true on node 0: p50 / p99
    cpu       nodes 1.. write --rate pages/s in all for --seconds; node 0's CPU share (the
              file-per-page tier finds pages by rescans: one rescan's CPU / its 30 s interval)
    metadata  node 0 finding 1,000 pages node 2 wrote: file-system calls counted (os.*)
    memory    the index's Python bytes a page (tracemalloc, a fresh process)

Targets (issue 55): p99 <= 1 s, discovery <= 1% of a core at 1,000 pages/s, a few metadata
calls for 1,000 pages, ready <= 5 s, <= 100 bytes a page, at 1 M pages on 4 nodes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time

import orjson

from loadtest.micro.recovery import identity, key_of, make_pages
from sidecar.tiers import hf3fs_log as hlog
from sidecar.tiers import hf3fs_slots as slots
from sidecar.tiers.hf3fs_index import page_hash
from sidecar.tiers.hf3fs_tier import COMPACT_AT

IDENTS = 4
TARGETS = {"p99_s": 1.0, "cpu_share": 0.01, "metadata_ops": 10, "ready_s": 5.0, "bytes": 100}
RESCAN_S = 30.0  # the file-per-page tier's default --hf3fs-rescan
META = ("open", "stat", "lstat", "fstat", "listdir", "scandir", "access", "mkdir", "rename")


# -- preloading the slotted layout ----------------------------------------------------
def _slotted_node(job: tuple[str, int, int, int, int, int]) -> int:
    """Write node `k`'s pages (i % nodes == k): slot files, snapshot, log tail."""
    root, k, nodes, n, page_bytes, log_tail = job
    d = os.path.join(root, "nodes", f"bench-{k}")
    os.makedirs(d, 0o700, exist_ok=True)
    mine = range(k, n, nodes)
    stride, room = slots.stride(page_bytes), slots.head_room(page_bytes)
    page = bytes([7]) * page_bytes
    raws = [bytes.fromhex(identity(i)) for i in range(IDENTS)]
    tag = hlog.node_tag(f"bench-{k}")
    entries, recs = bytearray(), []
    in_snap = len(mine) - min(log_tail, len(mine))
    for f in range(-(-len(mine) // slots.SLOTS)):
        buf = bytearray(slots.SLOTS * stride)
        for s, i in enumerate(mine[f * slots.SLOTS : (f + 1) * slots.SLOTS]):
            key, no = key_of(i), i % IDENTS
            head = slots.encode_header(raws[no], key, page)
            buf[s * stride : s * stride + len(head)] = head
            buf[s * stride + room : s * stride + room + page_bytes] = page
            h = page_hash(raws[no], key)
            if f * slots.SLOTS + s < in_snap:
                entries += h.to_bytes(8, "little") + (no << 48 | f << 6 | s).to_bytes(8, "little")
            else:
                rec = hlog.Record(hlog.PUT, h, tag, raws[no], f, s, page_bytes, 0, key)
                recs.append(hlog.encode(rec))
        with open(os.path.join(d, slots.file_name(f)), "wb") as out:
            out.write(buf)
    files = [(f, page_bytes, slots.SLOTS) for f in range(-(-len(mine) // slots.SLOTS))]
    with open(os.path.join(d, hlog.snap_name(1)), "wb") as out:
        out.write(hlog.encode_snapshot(1, raws, files, bytes(entries)))
    with open(os.path.join(d, hlog.log_name(1)), "wb") as out:
        out.write(b"".join(recs))
    return len(mine)


def make_slotted(root: str, n: int, nodes: int, page_bytes: int, workers: int) -> float:
    t = time.perf_counter()
    jobs = [(root, k, nodes, n, page_bytes, COMPACT_AT) for k in range(nodes)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        assert sum(pool.map(_slotted_node, jobs)) == n
    return time.perf_counter() - t


# -- one node (a process) -----------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _tier(layout: str, root: str, name: str):
    if layout == "slotted":
        from sidecar.tiers.hf3fs_tier import Hf3fsTier

        return Hf3fsTier(root, node=name)
    from sidecar.tiers.file_tier import FileTier

    return FileTier("hf3fs", root, shared=True)


class Node:
    """What a node process does on each command (`node_main` dispatches)."""

    def __init__(self, layout: str, root: str, name: str):
        self.layout, self.root, self.name = layout, root, name
        self.tier = None
        self.page = bytes([7]) * 512

    def start(self) -> dict:
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        rss, t, cpu = _rss(), time.perf_counter(), time.process_time()
        self.tier = _tier(self.layout, self.root, self.name)
        pages = self.tier.recover()
        return {
            "ready_s": time.perf_counter() - t,
            "ready_cpu_s": time.process_time() - cpu,
            "pages": pages,
            "rss_per_page": (_rss() - rss) / max(pages, 1),
        }

    def write(self, lo: int, hi: int, rate: float, batch: int) -> list[float]:
        """Write keys [lo, hi) at `rate` pages/s in batches; each page's ack time."""
        acks, t0 = [], time.monotonic()
        for b in range(lo, hi, batch):
            jobs = [
                (identity(i % IDENTS), key_of(i), self.page) for i in range(b, min(b + batch, hi))
            ]
            assert all(self.tier.write_batch(jobs))
            now = time.monotonic()
            acks += [now] * len(jobs)
            wait = t0 + (b + batch - lo) / rate - now
            if wait > 0:
                time.sleep(wait)
        return acks

    def watch(self, lo: int, hi: int, timeout: float) -> list[float | None]:
        """When each key of [lo, hi) became present here (checked every 0.5 ms)."""
        found: list[float | None] = []
        deadline = time.monotonic() + timeout
        for i in range(lo, hi):
            ident, key = identity(i % IDENTS), key_of(i)
            while not self.tier.contains(ident, key):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.0005)
            found.append(time.monotonic() if self.tier.contains(ident, key) else None)
        return found

    def cpu(self, seconds: float) -> dict:
        """This process's CPU share over `seconds` of doing nothing but its discovery."""
        c, t = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        out = {"share": (time.process_time() - c) / (time.perf_counter() - t)}
        if self.layout == "file":  # its discovery is the rescan
            c = time.process_time()
            self.tier.recover()
            out["rescan_cpu_s"] = time.process_time() - c
            out["share"] += out["rescan_cpu_s"] / RESCAN_S
        return out

    def metadata(self, lo: int, hi: int, timeout: float) -> dict:
        """File-system calls (every thread) until keys [lo, hi) are all present here."""
        counts = dict.fromkeys(META, 0)
        real = {name: getattr(os, name) for name in META}

        def counted(name):
            def call(*a, **kw):
                counts[name] += 1
                return real[name](*a, **kw)

            return call

        for name in META:
            setattr(os, name, counted(name))
        try:
            found = self.watch(lo, hi, timeout)
        finally:
            for name, fn in real.items():
                setattr(os, name, fn)
        return {
            "ops": sum(counts.values()),
            "by_call": counts,
            "found": sum(f is not None for f in found),
        }


def node_main(conn, layout: str, root: str, name: str) -> None:
    node = Node(layout, root, name)
    while True:
        cmd, args = conn.recv()
        if cmd == "close":
            if node.tier is not None:
                node.tier.close()
            conn.send(None)
            return
        conn.send(getattr(node, cmd)(*args))


class Cluster:
    def __init__(self, layout: str, root: str, n: int):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for k in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=node_main, args=(child, layout, root, f"bench-{k}"), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def ask(self, k: int, cmd: str, *args):
        self.conns[k].send((cmd, args))
        return self.conns[k].recv()

    def send(self, k: int, cmd: str, *args) -> None:
        self.conns[k].send((cmd, args))

    def close(self) -> None:
        for k, p in enumerate(self.procs):
            if p.is_alive():
                self.ask(k, "close")
            p.join(30)


# -- the measurements ---------------------------------------------------------------------
_MEMORY = """
import gc, sys, tracemalloc
from loadtest.micro.hf3fs import _tier
tier = _tier(sys.argv[1], sys.argv[2], "bench-memory")
gc.collect()
tracemalloc.start()
n = tier.recover()
gc.collect()
now, peak = tracemalloc.get_traced_memory()
print(n, now, peak)
"""


def index_memory(layout: str, root: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY, layout, root],
        capture_output=True,
        text=True,
        check=True,
        timeout=1200,
    ).stdout.split()
    n, now, peak = int(out[0]), int(out[1]), int(out[2])
    return {"pages": n, "bytes_per_page": now / max(n, 1), "peak_per_page": peak / max(n, 1)}


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def latency(c: Cluster, base: int, n: int, rate: float) -> dict:
    """Node 1 writes n pages at `rate`; node 0 watches them arrive."""
    c.send(0, "watch", base, base + n, 30.0)
    acks = c.ask(1, "write", base, base + n, rate, 10)
    found = c.conns[0].recv()
    lat = [f - a for f, a in zip(found, acks, strict=True) if f is not None]
    return {
        "pages": n,
        "found": len(lat),
        "p50_s": _pct(lat, 0.5),
        "p99_s": _pct(lat, 0.99),
        "max_s": max(lat, default=float("nan")),
    }


def discovery_cpu(c: Cluster, base: int, rate: float, seconds: float) -> dict:
    """Nodes 1.. write `rate` pages/s in all for `seconds`; node 0's CPU share meanwhile."""
    writers = list(range(1, len(c.conns)))
    each = int(rate * seconds / len(writers))
    c.send(0, "cpu", seconds)
    for j, k in enumerate(writers):
        c.send(k, "write", base + j * each, base + (j + 1) * each, rate / len(writers), 25)
    for k in writers:
        c.conns[k].recv()
    out = c.conns[0].recv()
    out.update(rate=rate, seconds=seconds, pages=each * len(writers))
    out["found"] = sum(
        f is not None for f in c.ask(0, "watch", base, base + each * len(writers), 10.0)
    )
    return out


def measure_layout(layout: str, root: str, args) -> dict:
    t = time.perf_counter()
    if layout == "slotted":
        made = make_slotted(root, args.pages, args.nodes, 512, args.workers)
    else:
        made = make_pages(root, args.pages, IDENTS, 512, args.workers)
    print(f"{layout}: wrote {args.pages} pages in {made:.1f} s", flush=True)
    c = Cluster(layout, root, args.nodes)
    try:
        starts = [c.ask(k, "start") for k in range(args.nodes)]
        print(f"{layout}: started {args.nodes} nodes: {[round(s['ready_s'], 2) for s in starts]}")
        base = args.pages
        res: dict = {"layout": layout, "starts": starts}
        res["latency"] = latency(c, base, args.latency_pages, args.rate)
        base += args.latency_pages
        res["cpu"] = discovery_cpu(c, base, args.rate, args.seconds)
        base += int(args.rate * args.seconds) + args.nodes
        c.send(0, "metadata", base, base + 1000, 30.0)  # counting from before the writes
        c.ask(2, "write", base, base + 1000, 1e9, 64)
        res["metadata"] = c.conns[0].recv()
        res["restart"] = c.ask(0, "start")
    finally:
        c.close()
    res["memory"] = index_memory(layout, root)
    res["wall_s"] = time.perf_counter() - t
    return res


def report(results: list[dict]) -> None:
    print(f"{'':28s}" + "".join(f"{r['layout']:>20s}" for r in results) + f"{'target':>12s}")
    rows = [
        ("exists on another p50 (s)", lambda r: r["latency"]["p50_s"], None),
        ("exists on another p99 (s)", lambda r: r["latency"]["p99_s"], TARGETS["p99_s"]),
        ("discovery CPU (core share)", lambda r: r["cpu"]["share"], TARGETS["cpu_share"]),
        ("metadata ops / 1,000 pages", lambda r: r["metadata"]["ops"], TARGETS["metadata_ops"]),
        ("restart to ready (s)", lambda r: r["restart"]["ready_s"], TARGETS["ready_s"]),
        ("restart CPU (s)", lambda r: r["restart"]["ready_cpu_s"], TARGETS["ready_s"]),
        ("index bytes / page", lambda r: r["memory"]["bytes_per_page"], TARGETS["bytes"]),
        ("RSS growth / page (start)", lambda r: r["restart"]["rss_per_page"], None),
    ]
    for name, get, target in rows:
        cells = "".join(f"{get(r):>20.4g}" for r in results)
        print(f"{name:28s}{cells}{'' if target is None else f'{target:>12g}'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pages", type=int, default=1_000_000, help="pages shared (1,000,000)")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", type=float, default=1000.0, help="new pages/s, all nodes (1,000)")
    p.add_argument("--seconds", type=float, default=10.0, help="of the CPU measurement (10)")
    p.add_argument("--latency-pages", type=int, default=500)
    p.add_argument("--workers", type=int, default=2, help="processes preloading pages")
    p.add_argument("--layouts", default="slotted,file", help="slotted, file or both (default)")
    p.add_argument("--dir", help="a directory standing in for the mount (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.nodes < 3:
        p.error("--nodes must be at least 3 (a watcher, a writer, a third for the metadata)")
    results = []
    base = tempfile.mkdtemp(prefix="kv-bench-3fs-", dir=args.dir)
    try:
        for layout in args.layouts.split(","):
            root = os.path.join(base, layout)
            results.append(measure_layout(layout, root, args))
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.pages} pages shared, {args.nodes} nodes, load {os.getloadavg()[0]:.1f}")
    report(results)
    if args.json:
        print(orjson.dumps(results).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
