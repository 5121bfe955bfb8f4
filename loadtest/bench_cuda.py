"""`python -m loadtest.bench_cuda` (GPU node): CUDA IPC set (D2H) and get (H2D) through the
sidecar against a torch copy between pinned host memory and the device, same bytes, one run."""
from __future__ import annotations

import statistics
import sys
import time

import torch

from api.engine.client import SidecarClient
from api.engine.cuda_export import register_cuda
from loadtest.procs import start_sidecar

PAGES, PAGE = 64, 2 << 20


def torch_limit(nbytes: int, reps: int) -> tuple[float, float]:
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


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 2
    side = start_sidecar("--host-pool", "4GiB", "--no-file-tier")
    try:
        c = SidecarClient(side.url, timeout=120)
        c.put_namespace("bench-cuda", PAGE)
        kv = torch.randint(0, 256, (PAGES, PAGE), dtype=torch.uint8, device="cuda")
        bid = register_cuda(c, "bench-cuda", [kv], PAGES)
        sets, gets = [], []
        for r in range(16):
            keys = [f"r{r}-{i}" for i in range(PAGES)]
            t = time.perf_counter()
            assert all(c.set("bench-cuda", keys, bid, list(range(PAGES))))
            t1 = time.perf_counter()
            assert all(c.get("bench-cuda", keys, bid, list(range(PAGES))))
            if r:
                sets.append(t1 - t)
                gets.append(time.perf_counter() - t1)
    finally:
        side.stop()
    nbytes = PAGES * PAGE
    d2h, h2d = torch_limit(nbytes, 15)
    s, g = nbytes / statistics.median(sets) / 1e9, nbytes / statistics.median(gets) / 1e9
    print(f"cuda_ipc set (D2H) {s:.2f} GB/s vs torch pinned copy {d2h:.2f} GB/s -> {s / d2h:.2f}x (target >= 0.8x)")
    print(f"cuda_ipc get (H2D) {g:.2f} GB/s vs torch pinned copy {h2d:.2f} GB/s -> {g / h2d:.2f}x (target >= 0.8x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
