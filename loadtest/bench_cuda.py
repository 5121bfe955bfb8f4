"""`python -m loadtest.bench_cuda` (GPU node): CUDA IPC set (device -> host pool) and get (host
pool -> device) of 64 x 2 MiB pages through a sidecar with its host pool cudaHostRegister-ed,
against torch's own copy of the same bytes between pinned host memory and the device, in the
same run (goal >= 0.9x); and the time of a registration (export + the sidecar's open).

Prints one line per figure and a last line `bench_cuda: ...` (scripts/gpu_check.sh's summary);
exit 0 when measured (whatever the ratios), 2 without a device, 1 when a copy failed.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from api.engine.client import SidecarClient
from api.engine.cuda_export import cuda_regions_and_chunks, register_cuda
from loadtest.procs import start_sidecar

PAGES, PAGE, ROUNDS, GOAL = 64, 2 << 20, 12, 0.9


def torch_limit(nbytes: int, reps: int) -> tuple[float, float]:
    """GB/s of torch's device -> pinned and pinned -> device copies of `nbytes` (medians)."""
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


def main() -> int:
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


if __name__ == "__main__":
    sys.exit(main())
