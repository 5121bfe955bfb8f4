"""`python -m loadtest.micro.cuda_copy` (GPU node): CUDA IPC set (device -> host pool) and get (host
pool -> device) of 64 x 2 MiB pages through a sidecar with its host pool cudaHostRegister-ed,
against torch's own copy of the same bytes between pinned host memory and the device, in the
same run (goal >= 0.9x); and the time of a registration (export + the sidecar's open).

Prints one line per figure and a last line `bench_cuda: ...` (scripts/gpu_check.sh's summary);
exit 0 when measured (whatever the ratios), 2 without a device, 1 when a copy failed.

`--sweep` (issue 54): the sidecar's copy path as a copy thread runs it (plan, submission,
copy engines, one stream sync; no HTTP, no store), for pages of 8 KiB, 64 KiB and 2 MiB,
engine pages contiguous and scattered (random block ids), set and get, each against one
raw pinned cudaMemcpyAsync of the same bytes in the same run; a table in the log, and the
CPU time of the submission a 1,000 runs. `--sweep --dry-run` runs it on host memory through
a CUDA double (sidecar/transports/cuda_double.py): no GPU, the figures meaningless.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from api.engine.client import SidecarClient
from api.engine.cuda_export import cuda_regions_and_chunks, register_cuda
from loadtest.kit.procs import start_sidecar
from pools.page_pool import PagePool
from sidecar.transports.base import YIELD_RUNS, Chunk, build_plan, copy_jobs
from sidecar.transports.cuda_double import HostCuda
from sidecar.transports.cuda_ipc import CudaIpc, IpcMapping

if TYPE_CHECKING:
    import torch

PAGES, PAGE, ROUNDS, GOAL = 64, 2 << 20, 12, 0.9


def torch_limit(nbytes: int, reps: int) -> tuple[float, float]:
    """GB/s of torch's device -> pinned and pinned -> device copies of `nbytes` (medians)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h, h2d = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(t1 - t)
        h2d.append(time.perf_counter() - t1)
    return nbytes / statistics.median(d2h[1:]) / 1e9, nbytes / statistics.median(h2d[1:]) / 1e9


def registration_ms(
    c: SidecarClient, kv: torch.Tensor, reps: int = 5
) -> tuple[float, float, float]:
    """(export ms, first register ms, median register ms): each registration after a release
    opens the IPC handle again in the sidecar (its last user closed it)."""
    t = time.perf_counter()
    cuda_regions_and_chunks([kv])
    export = (time.perf_counter() - t) * 1e3
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        bid = register_cuda(c, "bench-cuda-reg", [kv], PAGES)
        times.append((time.perf_counter() - t) * 1e3)
        c.release_buffer("bench-cuda-reg", bid)
    return export, times[0], statistics.median(times[1:])


def run(
    c: SidecarClient, pages: int = PAGES
) -> tuple[list[float], list[float], tuple[float, float, float]]:
    import torch

    c.put_namespace("bench-cuda", PAGE)
    c.put_namespace("bench-cuda-reg", PAGE)
    kv = torch.randint(0, 256, (pages, PAGE), dtype=torch.uint8, device="cuda")
    back = torch.zeros_like(kv)
    torch.cuda.synchronize()
    reg = registration_ms(c, kv)
    bid = register_cuda(c, "bench-cuda", [kv], pages)
    into = register_cuda(c, "bench-cuda", [back], pages)
    sets, gets = [], []
    for r in range(ROUNDS + 1):
        keys = [f"r{r}-{i}" for i in range(pages)]
        t = time.perf_counter()
        if not all(c.set("bench-cuda", keys, bid, list(range(pages)))):
            raise RuntimeError("a set answered false")
        t1 = time.perf_counter()
        if not all(c.get("bench-cuda", keys, into, list(range(pages)))):
            raise RuntimeError("a get answered false")
        t2 = time.perf_counter()
        if r:  # the first round opens streams and touches the pool's pages
            sets.append(t1 - t)
            gets.append(t2 - t1)
    torch.cuda.synchronize()
    if not torch.equal(kv, back):
        raise RuntimeError("the pages read back differ from the pages stored")
    return sets, gets, reg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="the copy path's sweep (issue 54)")
    ap.add_argument("--dry-run", action="store_true", help="--sweep on host memory, no GPU")
    ap.add_argument("--rounds", type=int, default=0, help="--sweep: rounds a row (0: default)")
    args = ap.parse_args(argv)
    if args.sweep or args.dry_run:
        return sweep_main(args.dry_run, args.rounds)
    import torch

    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device: nothing to measure")
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    side = start_sidecar("--host-pool", "4GiB", "--no-file-tier")
    try:
        c = SidecarClient(side.socket_url, timeout=120)
        registered = c.stats()["cuda_host_registered"]
        sets, gets, (export, first, again) = run(c)
    except Exception as exc:
        print(f"bench_cuda: FAILED: {type(exc).__name__}: {exc}")
        return 1
    finally:
        side.stop()
    nbytes = PAGES * PAGE
    d2h, h2d = torch_limit(nbytes, ROUNDS)
    s, g = nbytes / statistics.median(sets) / 1e9, nbytes / statistics.median(gets) / 1e9
    print(f"device {torch.cuda.get_device_name()}; host pool cudaHostRegister-ed: {registered}")
    print(
        f"set (D2H) {PAGES} x {PAGE >> 20} MiB: {s:.1f} GB/s vs torch pinned copy {d2h:.1f} GB/s "
        f"-> {s / d2h:.2f}x (goal >= {GOAL}x; medians of {ROUNDS}, request included)"
    )
    print(
        f"get (H2D) {PAGES} x {PAGE >> 20} MiB: {g:.1f} GB/s vs torch pinned copy {h2d:.1f} GB/s "
        f"-> {g / h2d:.2f}x (goal >= {GOAL}x)"
    )
    print(
        f"registration of a {nbytes >> 20} MiB tensor: export {export:.2f} ms; register "
        f"(sidecar opens the handle) first {first:.2f} ms, then median {again:.2f} ms"
    )
    sweep(d2h, h2d)
    met = "met" if min(s / d2h, g / h2d) >= GOAL else "NOT met"
    print(
        f"bench_cuda: set {s / d2h:.2f}x get {g / h2d:.2f}x of torch pinned ({met}); "
        f"register {again:.1f} ms; host registered {registered}"
    )
    return 0


def sweep(d2h: float, h2d: float) -> None:
    """Where the rest goes: the same moves with one copy thread (one stream, no split) and
    with 256 pages a request (a fixed cost a request shrinks 4x against the bytes)."""
    for args, pages in (((), 256), (("--copy-threads", "1"), 64), (("--copy-threads", "1"), 256)):
        side = start_sidecar("--host-pool", "8GiB", "--no-file-tier", *args)
        try:
            sets, gets, _ = run(SidecarClient(side.socket_url, timeout=120), pages)
        except Exception as exc:
            print(f"sweep {args} {pages}: FAILED {type(exc).__name__}: {exc}")
            continue
        finally:
            side.stop()
        n = pages * PAGE
        ms = (statistics.median(sets) * 1e3, statistics.median(gets) * 1e3)
        floor = (n / d2h / 1e6, n / h2d / 1e6)  # the torch copy of the same bytes, ms
        print(
            f"sweep {' '.join(args) or 'default threads'}, {pages} pages: set {ms[0]:.2f} ms "
            f"({n / ms[0] / 1e6 / d2h:.2f}x, +{ms[0] - floor[0]:.2f} ms over torch), get "
            f"{ms[1]:.2f} ms ({n / ms[1] / 1e6 / h2d:.2f}x, +{ms[1] - floor[1]:.2f} ms)"
        )


# -- the sweep (issue 54) ------------------------------------------------------------------
SWEEP = (
    (8 << 10, 64),
    (8 << 10, 1024),
    (8 << 10, 8192),
    (64 << 10, 1024),
    (2 << 20, 64),
    (2 << 20, 256),
)
SWEEP_ROUNDS, DRY_ROUNDS = 10, 1
DRY_BYTES = 32 << 20  # a dry run's cap on a request's bytes: its pages cut to fit
SCATTER = 2  # scattered engine pages: random block ids among this many times the pages
TAG = 8  # bytes at each end of a page that tell which page it is


@dataclass
class Row:
    page: int
    pages: int
    layout: str  # the engine's pages: "contiguous" or "scattered"
    way: str  # "set" (device -> host pool) or "get" (host pool -> device)
    runs: int  # runs of the request's plans
    calls: int  # driver calls a request (counted by the double in a dry run)
    ms: float  # median: the copy path, as a copy thread runs it
    raw_ms: float  # median: one cudaMemcpyAsync of the same bytes, pinned <-> device
    submit_us: float  # CPU time handing the request's runs to the driver, as one plan
    submit_runs: int  # the runs of that plan

    @property
    def ratio(self) -> float:
        return self.raw_ms / self.ms

    @property
    def per_k(self) -> float:
        """Submission microseconds a 1,000 runs."""
        return self.submit_us / self.submit_runs * 1000

    def line(self) -> str:
        size = f"{self.page >> 20} MiB" if self.page >= 1 << 20 else f"{self.page >> 10} KiB"
        per_k = f"{self.per_k:.1f}" if self.submit_runs >= 64 else "-"
        return (
            f"{size:>7} {self.pages:>6}  {self.layout:<10}  {self.way}  {self.runs / self.pages:>9.4f}"
            f"  {self.calls:>5}  {self.ms:>8.3f}  {self.raw_ms:>8.3f}  {self.ratio:>5.2f}x"
            f"  {self.submit_us:>9.1f}  {per_k:>10}"
        )


HEADER = (
    "   page  pages  engine      dir   runs/page  calls   copy ms    raw ms  ratio"
    "  submit us  us/1k runs"
)


def _ok(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)}")
    return rest[0] if rest else None


class Sweep:
    """The sweep's device side: the sidecar's own `CudaIpc` (its streams, its submission)
    over cuda-python, or over the host-memory double (`double`) in a dry run."""

    def __init__(self, cuda: CudaIpc, double: HostCuda | None = None):
        self.cuda, self.rt, self.double, self.dev = cuda, cuda.rt, double, 0
        self.kind = self.rt.cudaMemcpyKind.cudaMemcpyDefault
        self.held: list[tuple[int, bool]] = []

    def alloc(self, n: int, host: bool) -> int:
        fn = self.rt.cudaMallocHost if host else self.rt.cudaMalloc
        ptr = int(_ok(fn(n), "cudaMallocHost" if host else "cudaMalloc"))
        self.held.append((ptr, host))
        return ptr

    def free_all(self) -> None:
        while self.held:
            ptr, host = self.held.pop()
            (self.rt.cudaFreeHost if host else self.rt.cudaFree)(ptr)

    def driver_calls(self) -> int:
        d = self.double
        return d.calls["cuMemcpyBatchAsync"] + d.calls["cuMemcpyAsync"] if d else 0

    def raw(self, dst: int, src: int, n: int) -> float:
        """Seconds of one cudaMemcpyAsync of `n` bytes and its stream sync."""
        _ok(self.rt.cudaSetDevice(self.dev), "cudaSetDevice")
        stream = self.cuda.stream(self.dev)
        t = time.perf_counter()
        _ok(self.rt.cudaMemcpyAsync(dst, src, n, self.kind, stream), "cudaMemcpyAsync")
        _ok(self.rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        return time.perf_counter() - t

    def submit_us(self, mapping, chunks, pages, into: bool) -> tuple[int, float]:
        """(runs, best CPU microseconds of 3) of handing one plan of all `pages` to the
        driver (`CudaIpc.submit`: the C call), its copies waited for apart."""
        plan = build_plan(chunks, mapping.addresses, pages, into)
        best = float("inf")
        for _ in range(3):
            _ok(self.rt.cudaSetDevice(self.dev), "cudaSetDevice")
            t = time.perf_counter()
            self.cuda.submit(self.dev, plan)
            best = min(best, time.perf_counter() - t)
            self.cuda.wait(self.dev)
        return len(plan), best * 1e6

    def measure(self, mapping, chunks, pages, into: bool, rounds: int, raw) -> tuple:
        """(median ms, raw median ms, runs, driver calls) of a request's move, rounds after
        one to warm up, each followed by the raw copy of the same bytes."""
        dst, src, n = raw if into else (raw[1], raw[0], raw[2])
        times, raws, runs, calls = [], [], 0, self.driver_calls()
        for r in range(rounds + 1):
            job = copy_jobs(mapping, chunks, pages, into, 1)[0]
            t = time.perf_counter()
            job()
            took = time.perf_counter() - t
            raw_s = self.raw(dst, src, n)
            if r:
                times.append(took)
                raws.append(raw_s)
            runs = job.runs
        calls = (self.driver_calls() - calls) // (rounds + 1)
        if not self.double:  # no counting on a device: what the entry points make it
            calls = -(-len(pages) // YIELD_RUNS) if self.cuda.calls.batch else runs
        return statistics.median(times) * 1e3, statistics.median(raws) * 1e3, runs, calls


def _tag(pages: list[tuple[int, int]], page: int, check: bool = False) -> bool:
    """Write (or check) each host page's tag: its index at both ends."""
    for i, (host, _) in enumerate(pages):
        tag = i.to_bytes(TAG, "little")
        if not check:
            ctypes.memmove(host, tag, TAG)
            ctypes.memmove(host + page - TAG, tag, TAG)
        elif ctypes.string_at(host, TAG) != tag or ctypes.string_at(host + page - TAG, TAG) != tag:
            return False
    return True


def sweep_case(sw: Sweep, page: int, pages: int, scattered: bool, rounds: int, rng) -> list[Row]:
    """Set and get rows of one case: `pages` engine pages (random block ids when
    `scattered`) to host slots the pool places (adjacent), then back, bytes checked."""
    n, slots = pages * page, pages * (SCATTER if scattered else 1)
    ids = rng.sample(range(slots), pages) if scattered else list(range(pages))
    engine, host = sw.alloc(slots * page, False), sw.alloc(n, True)
    raw = (sw.alloc(n, False), sw.alloc(n, True), n)  # (device, pinned host, bytes)
    pool = PagePool("sweep", page, n, max_pages=pages)
    pool.add_segment(0)
    moves = [(host + pool.reserve(str(i)).offset, s) for i, s in enumerate(ids)]
    mapping, chunks = IpcMapping.local(sw.cuda, sw.dev, [engine]), (Chunk(0, page, page),)
    layout, out = "scattered" if scattered else "contiguous", []
    _tag(moves, page)
    get = sw.measure(mapping, chunks, moves, True, rounds, raw)  # tags: host -> engine
    ctypes.memset(host, 0, n)
    put = sw.measure(mapping, chunks, moves, False, rounds, raw)  # and back
    if not _tag(moves, page, check=True):
        raise RuntimeError(f"{pages} x {page} B {layout}: the pages came back wrong")
    for way, (ms, raw_ms, runs, calls), into in (("set", put, False), ("get", get, True)):
        plan_runs, us = sw.submit_us(mapping, chunks, moves, into)
        out.append(Row(page, pages, layout, way, runs, calls, ms, raw_ms, us, plan_runs))
    sw.free_all()
    return out


def sweep_main(dry: bool, rounds: int = 0) -> int:
    """The sweep's table and its last line `bench_cuda sweep: ...`; 0 measured, 2 without
    a device (not a dry run), 1 when a copy failed or bytes came back wrong."""
    double = HostCuda() if dry else None
    cuda = CudaIpc((double, double)) if double else CudaIpc.create()
    if cuda is None:
        print("bench_cuda sweep: no CUDA device: nothing to measure")
        return 2
    rounds = rounds or (DRY_ROUNDS if dry else SWEEP_ROUNDS)
    sw, rng, rows = Sweep(cuda, double), random.Random(54), []
    what = "dry run: host memory through the CUDA double, not device figures" if dry else "device"
    print(f"sweep ({what}); {cuda.calls.describe()}; medians of {rounds} rounds")
    print(HEADER)
    try:
        for page, pages in SWEEP:
            if dry:
                pages = max(1, min(pages, DRY_BYTES // page))
            for scattered in (False, True):
                for row in sweep_case(sw, page, pages, scattered, rounds, rng):
                    print(row.line(), flush=True)
                    rows.append(row)
    except Exception as exc:
        sw.free_all()
        print(f"bench_cuda sweep: FAILED: {type(exc).__name__}: {exc}")
        return 1
    print(f"bench_cuda sweep: {sweep_summary(rows, dry)}")
    return 0


def sweep_summary(rows: list[Row], dry: bool) -> str:
    """The figures the issue's targets name, and runs per page by engine layout."""

    def low(pick) -> float:
        return min((r.ratio for r in rows if pick(r)), default=float("nan"))

    most = max((r.pages for r in rows if r.page == 8 << 10), default=0)
    big = low(lambda r: r.page == 2 << 20)
    small = low(lambda r: r.page == 8 << 10 and r.layout == "scattered" and r.pages == most)
    per_k = max((r.per_k for r in rows if r.submit_runs >= 1000), default=float("nan"))
    per_page = []
    for lay in ("contiguous", "scattered"):
        runs, pages = (
            sum(getattr(r, f) for r in rows if r.layout == lay) for f in ("runs", "pages")
        )
        per_page.append(f"{lay} {runs / max(pages, 1):.4f}")
    figures = (
        f"2 MiB pages {big:.2f}x of the raw copy (goal >= 0.95x); 8 KiB x {most} scattered "
        f"{small:.2f}x (goal >= 0.80x); submission {per_k:.1f} us per 1,000 runs (goal <= 50); "
        f"runs per page {', '.join(per_page)}; {len(rows)} rows"
    )
    return ("dry run, not device figures: " if dry else "") + figures


if __name__ == "__main__":
    sys.exit(main())
