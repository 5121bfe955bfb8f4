"""`python -m loadtest.micro.restore` (`make bench-restore`): a vLLM CPU restore against
memcpy, without vLLM, on a busy machine too (`--busy N`).

    the engine's KV cache (one memfd, as KvArena)       the sidecar's host pool
    L0: [b0][b1][b2]..  L1: [b0][b1]..  .. L11: ..  <--  page = one slot, 12 x 64 KiB
    a restore: exists(keys), then get(keys, block ids): 12 runs of 64 KiB a block

Pages are set once; each round, for each size (in an order that rotates), times a
one-thread memmove of the same bytes between two warm buffers, the same bytes on the
sidecar's copy parallelism (Python threads, each a slice), then the restore on the
engine socket: `exists` and `get`. The sidecar's `copies` stats (operator view, deltas
around the get) split the get: the wait before its first copy job starts (the hand-off),
the copy (first job started to last ended), the settle (last job ended to the loop
running its end), and the rest (HTTP, validation, pinning, the answer). Medians over the
kept rounds, paired by round; limit = bytes / (0.8 x memcpy) + 5 ms, memcpy from the
same round. `--busy N` starts N processes that burn a CPU each beside it.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer
from loadtest.kit.procs import Proc, start_sidecar

MIB = 1 << 20
TOKEN = "bench-restore"
NAMESPACE = "bench-restore"
LIMIT_SHARE, LIMIT_FIXED = 0.8, 0.005  # limit = bytes / (0.8 x memcpy) + 5 ms


@dataclass(frozen=True)
class Layout:
    """vLLM's CPU KV cache as KvArena makes it: layer-major, one `run` per layer a block."""

    layers: int
    run: int
    blocks: int

    @property
    def page_bytes(self) -> int:
        return self.layers * self.run

    @property
    def size(self) -> int:
        return self.layers * self.blocks * self.run

    def chunks(self) -> list[dict]:
        per_layer = self.blocks * self.run
        return [
            {"offset": i * per_layer, "stride": self.run, "size": self.run}
            for i in range(self.layers)
        ]

    def address(self, base: int, layer: int, block: int) -> int:
        return base + (layer * self.blocks + block) * self.run


class Memcpy:
    """The limit's copies between two warm anonymous buffers: one thread, and `threads`
    Python threads each moving a slice (ctypes releases the GIL around memmove)."""

    def __init__(self, nbytes: int, threads: int):
        self.maps = [mmap.mmap(-1, nbytes) for _ in range(2)]
        self.src, self.dst = (ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in self.maps)
        ctypes.memset(self.src, 1, nbytes)
        ctypes.memset(self.dst, 2, nbytes)
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)

    def one(self, n: int) -> float:
        t = time.perf_counter()
        ctypes.memmove(self.dst, self.src, n)
        return time.perf_counter() - t

    def split(self, n: int) -> float:
        per = -(-n // self.threads)
        t = time.perf_counter()
        parts = [
            self.pool.submit(ctypes.memmove, self.dst + o, self.src + o, min(per, n - o))
            for o in range(0, n, per)
        ]
        for p in parts:
            p.result()
        return time.perf_counter() - t

    def close(self) -> None:
        self.pool.shutdown()


def keys_of(n: int) -> list[str]:
    return [hashlib.sha256(f"bench-restore-{i}".encode()).hexdigest() for i in range(n)]


def fill(layout: Layout, base: int, blocks: range, zero: bool = False) -> None:
    """Each run of each block one byte value, (block x layers + layer) % 251 (or zeros)."""
    for b in blocks:
        for layer in range(layout.layers):
            value = 0 if zero else (b * layout.layers + layer) % 251
            ctypes.memset(layout.address(base, layer, b), value, layout.run)


def check(layout: Layout, base: int, blocks: range) -> None:
    """Every run holds its value at both ends (what `fill` wrote before the set)."""
    for b in blocks:
        for layer in range(layout.layers):
            a, want = layout.address(base, layer, b), (b * layout.layers + layer) % 251
            got = (
                ctypes.c_ubyte.from_address(a).value,
                ctypes.c_ubyte.from_address(a + layout.run - 1).value,
            )
            assert got == (want, want), f"block {b} layer {layer}: {got}, want {want}"


def copies(stats: SidecarClient) -> dict:
    """The sidecar's copy timings so far (zeros where it reports none)."""
    got = stats.stats().get("copies") or {}
    return {k: float(got.get(k, 0)) for k in ("moves", "wait_s", "copy_s", "settle_s")}


def schedstat(pid: int) -> tuple[float, float]:
    """(on a CPU, waiting for one) seconds so far, summed over the process's threads."""
    run = wait = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                fields = f.read().split()
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
        run, wait = run + int(fields[0]), wait + int(fields[1])
    return run / 1e9, wait / 1e9


def burners(n: int) -> list[subprocess.Popen]:
    """`n` processes that each burn one CPU until killed (the busy machine)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def loadavg() -> float:
    return os.getloadavg()[0]


class Bench:
    """A sidecar with the pages set, the engine's KV memfd registered, and the limit."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        top = max(args.sizes)
        self.layout = Layout(args.layers, args.run_kib << 10, 0)
        pages = top * MIB // self.layout.page_bytes
        self.layout = Layout(args.layers, args.run_kib << 10, pages + 2)
        pool = (pages * self.layout.page_bytes >> 20) + 64
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-restore-")
        token = os.path.join(self.tmp.name, "token")  # TCP with it: the operator's stats
        with open(token, "w") as f:
            f.write(TOKEN)
        extra = ["--copy-threads", str(args.copy_threads)] if args.copy_threads else []
        self.sidecar: Proc = start_sidecar(
            "--no-file-tier", "--host-pool", f"{pool}MiB", "--token-file", token, *extra
        )
        self.engine = SidecarClient(self.sidecar.socket_url, token=TOKEN)
        self.operator = SidecarClient(self.sidecar.url, token=TOKEN)
        self.kv = SharedBuffer(self.layout.size, name="kv-vllm-cache")
        self.keys = keys_of(pages)
        self.memcpy = Memcpy(top * MIB, args.threads or os.cpu_count() or 1)
        self.buffer_id = ""
        self.quiet: dict[int, float] = {}

    def nbytes(self, mib: int) -> int:
        """The bytes of a restore of `mib` MiB: whole pages."""
        return mib * MIB // self.layout.page_bytes * self.layout.page_bytes

    def setup(self) -> None:
        """Namespace, buffer, every page set from the KV blocks 1..pages; then one restore
        of all of them into zeroed blocks, checked (and every block faulted in for the
        sidecar's mapping, as a long-running engine has it)."""
        lay, n = self.layout, len(self.keys)
        self.engine.put_namespace(NAMESPACE, lay.page_bytes, model="bench-restore")
        self.buffer_id = self.kv.register(self.engine, NAMESPACE, lay.blocks, lay.chunks())
        blocks = list(range(1, n + 1))
        fill(lay, self.kv.address, range(1, n + 1))
        stored = self.engine.set(NAMESPACE, self.keys, self.buffer_id, blocks)
        assert all(stored), f"{stored.count(False)} pages not stored"
        fill(lay, self.kv.address, range(lay.blocks), zero=True)
        assert self.engine.exists(NAMESPACE, self.keys) == n
        assert all(self.engine.get(NAMESPACE, self.keys, self.buffer_id, blocks))
        check(lay, self.kv.address, range(1, n + 1))
        for mib in self.args.sizes:  # before any burner starts: the quiet memcpy
            size = self.nbytes(mib)
            self.quiet[mib] = statistics.median(self.memcpy.one(size) for _ in range(5))

    def round(self, mib: int) -> dict:
        """One paired measurement of `mib` MiB: memcpy (median of 3), the split copy, and
        a restore (exists + get) with the sidecar's copy timings around the get."""
        nbytes = self.nbytes(mib)
        n = nbytes // self.layout.page_bytes
        one = statistics.median(self.memcpy.one(nbytes) for _ in range(3))
        split = statistics.median(self.memcpy.split(nbytes) for _ in range(3))
        keys, blocks = self.keys[:n], list(range(1, n + 1))
        before = copies(self.operator)
        s0 = schedstat(self.sidecar.proc.pid)
        t0 = time.perf_counter()
        hit = self.engine.exists(NAMESPACE, keys)
        t1 = time.perf_counter()
        loaded = self.engine.get(NAMESPACE, keys, self.buffer_id, blocks)
        t2 = time.perf_counter()
        s1 = schedstat(self.sidecar.proc.pid)
        after = copies(self.operator)
        assert hit == n and all(loaded), "a restore missed"
        server = {k: after[k] - before[k] for k in after}
        assert server["moves"] in (0, 1), f"{server['moves']} moves: another client copied"
        return {
            "mib": mib,
            "bytes": nbytes,
            "memcpy_s": one,
            "split_s": split,
            "exists_s": t1 - t0,
            "get_s": t2 - t1,
            "wait_s": server["wait_s"],
            "copy_s": server["copy_s"],
            "settle_s": server["settle_s"],
            "cpu_s": s1[0] - s0[0],
            "runq_s": s1[1] - s0[1],
            "quiet_memcpy_s": self.quiet[mib],
            "load": loadavg(),
        }

    def close(self) -> None:
        self.memcpy.close()
        self.engine.close()
        self.operator.close()
        self.sidecar.stop()
        self.kv.close()
        self.tmp.cleanup()


def limit_s(nbytes: int, memcpy_s: float) -> float:
    """bytes / (0.8 x memcpy rate) + 5 ms."""
    return memcpy_s / LIMIT_SHARE + LIMIT_FIXED


def summary(runs: list[dict], mib: int) -> dict:
    """Medians over the rounds of one size; ratios paired by round, then their median."""
    rows = [r for r in runs if r["mib"] == mib]

    def med(f) -> float:
        return statistics.median(f(r) for r in rows)

    out = {k: med(lambda r, k=k: r[k]) for k in rows[0] if k != "mib"}
    out["restore_s"] = med(lambda r: r["exists_s"] + r["get_s"])
    out["rest_s"] = med(lambda r: r["get_s"] - r["wait_s"] - r["copy_s"] - r["settle_s"])
    out["limit_s"] = med(lambda r: limit_s(r["bytes"], r["memcpy_s"]))
    out["ratio"] = med(lambda r: (r["exists_s"] + r["get_s"]) / limit_s(r["bytes"], r["memcpy_s"]))
    out["get_ratio"] = med(lambda r: r["get_s"] / limit_s(r["bytes"], r["memcpy_s"]))
    out["quiet_ratio"] = med(
        lambda r: (r["exists_s"] + r["get_s"]) / limit_s(r["bytes"], r["quiet_memcpy_s"])
    )
    out["copy_x"] = med(lambda r: r["copy_s"] / r["memcpy_s"])
    out["rounds"] = len(rows)
    return out


def report(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    """Print the table; the summary rows."""
    loads = [r["load"] for r in runs]
    print(
        f"\n{args.rounds} rounds, --busy {args.busy}, load {min(loads):.1f}-{max(loads):.1f}, "
        f"{os.cpu_count()} CPUs. Medians, ms (GB/s). limit = bytes / (0.8 x memcpy) + 5 ms, "
        f"memcpy of the same round (quiet: measured before --busy started)"
    )
    print(
        "  MiB | memcpy 1t  | Nt    | exists | get: wait  copy  settle rest | restore     "
        "| sidecar cpu runq | limit | restore/limit   | /quiet limit | copy/memcpy"
    )
    out = []
    for mib in args.sizes:
        s = summary(runs, mib)
        gb = s["bytes"] / 1e9

        def ms(key: str, width: int = 5, s: dict = s) -> str:
            return f"{s[key] * 1e3:{width}.1f}"

        print(
            f"  {mib:3} | {ms('memcpy_s')} ({gb / s['memcpy_s']:4.1f}) | {ms('split_s')} | "
            f"{s['exists_s'] * 1e3:6.2f} | {s['wait_s'] * 1e3:8.2f} {ms('copy_s')} "
            f"{s['settle_s'] * 1e3:6.2f} {s['rest_s'] * 1e3:4.2f} | {ms('restore_s')} "
            f"({gb / s['restore_s']:4.1f}) | {ms('cpu_s', 11)} {ms('runq_s', 4)} | "
            f"{ms('limit_s')} | {s['ratio']:.2f}x {'met' if s['ratio'] <= 1 else 'NOT met':7} | "
            f"{s['quiet_ratio']:.2f}x        | {s['copy_x']:.2f}x"
        )
        out.append({"mib": mib, "busy": args.busy, **s})
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="24,96,192", help="MiB a restore, comma-separated")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and dropped")
    ap.add_argument("--busy", type=int, default=0, help="CPU-burning processes beside it")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--run-kib", type=int, default=64, help="one layer of one block")
    ap.add_argument("--threads", type=int, default=0, help="the split copy's (default: CPUs)")
    ap.add_argument("--copy-threads", type=int, default=0, help="the sidecar's --copy-threads")
    ap.add_argument("--json", default="", help="write the summary rows here")
    args = ap.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    return args


def run(args: argparse.Namespace) -> list[dict]:
    """The rounds (the warm-up ones dropped), the table printed; the summary rows."""
    bench = Bench(args)
    busy: list[subprocess.Popen] = []
    try:
        bench.setup()
        busy = burners(args.busy)
        runs = []
        for rnd in range(args.warmup + args.rounds):
            k = rnd % len(args.sizes)
            for mib in args.sizes[k:] + args.sizes[:k]:
                r = bench.round(mib)
                if rnd >= args.warmup:
                    runs.append(r)
        rows = report(runs, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"runs": runs, "summary": rows}, f, indent=1)
        return rows
    finally:
        for p in busy:
            p.kill()
            p.wait()
        bench.close()


def main(argv: list[str] | None = None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
