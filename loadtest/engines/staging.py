"""What the vLLM connector's CPU staging memfd costs, next to the sidecar's own copy, and a
load straight into a KV cache allocated in the connector's memfd (no staging).

    python -m loadtest.engines.staging [--pages 62] [--layers 8]

A CPU_ATTN-shaped KV cache ([blocks, kv_heads, 32, 2*head] per layer, float32) is saved and
loaded through a real sidecar; each round times the connector's copy into staging, the
sidecar's `get` into the same slots, and the copy from staging into the KV blocks. The
staging copies are what placing vLLM's own KV pool in shared memory would save.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

from api.engine.client import SidecarClient
from api.engine.vllm_layout import EngineScope, PageLayout, namespace_spec
from api.engine.vllm_scheduler import Transfer
from api.engine.vllm_worker import KvArena, WorkerSide, kv_chunks
from loadtest.kit.procs import start_sidecar


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=62)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.pages + 2
    caches = {f"l{i}": torch.randn(n, 4, 32, 256) for i in range(args.layers)}
    layout = PageLayout.of(caches, n)
    spec = namespace_spec(EngineScope("bench", "float32", 32, "CPU_ATTN", "sha256/32", {}), layout)
    sidecar = start_sidecar(
        "--no-file-tier", "--host-pool", f"{2 * n * layout.page_bytes >> 20}MiB"
    )
    w = WorkerSide(SidecarClient(sidecar.socket_url), layout, spec, args.pages)
    try:
        keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(args.pages)]
        blocks, slots = list(range(1, args.pages + 1)), list(range(args.pages))
        w.save([Transfer("r", keys, blocks)])
        w.drain()
        out, get, into, plain = [], [], [], []
        a = torch.empty(args.pages * layout.page_bytes, dtype=torch.uint8).fill_(1)
        b = torch.empty_like(a).fill_(2)
        for _ in range(args.rounds):
            t = time.perf_counter()
            b.copy_(a)  # the limit: one contiguous copy of the same bytes
            plain.append(time.perf_counter() - t)
            t0 = time.perf_counter()
            layout.to_staging(w.windows, blocks, slots)
            t1 = time.perf_counter()
            assert all(w._call(w.client.get, keys, slots))
            t2 = time.perf_counter()
            layout.from_staging(w.windows, slots, blocks)
            out.append(t1 - t0), get.append(t2 - t1), into.append(time.perf_counter() - t2)
        mb = args.pages * layout.page_bytes / 1e6
        o, g, i, p = (statistics.median(x) for x in (out, get, into, plain))
        print(
            f"{args.pages} pages of {layout.page_bytes >> 10} KiB ({mb:.0f} MB), medians of {args.rounds}: "
            f"KV->staging {o * 1e3:.1f} ms ({mb / o / 1e3:.1f} GB/s), sidecar get {g * 1e3:.1f} ms, "
            f"staging->KV {i * 1e3:.1f} ms ({mb / i / 1e3:.1f} GB/s); a load is get + staging->KV: "
            f"staging is {i / (g + i):.0%} of it. One plain copy of the bytes: {p * 1e3:.1f} ms "
            f"({mb / p / 1e3:.1f} GB/s): staging copies run at {p / o:.2f}x and {p / i:.2f}x of it"
        )
        direct(args, sidecar, spec, keys, blocks, p)
    finally:
        w.close()
        sidecar.stop()


def direct(args, sidecar, spec: dict, keys: list[str], blocks: list[int], plain: float) -> None:
    """The same load with the KV cache in the connector's memfd (KvArena, as inside vLLM):
    one copy, the sidecar's, into the KV blocks. Its first run pays the sidecar's page
    faults on its new mapping; the median is of the runs after it."""
    n = args.pages + 2
    per_layer = n * 4 * 32 * 256 * 4
    with KvArena() as arena:  # vLLM's one allocation, LBHNC: layer-major
        raw = torch.zeros(args.layers * per_layer, dtype=torch.int8)
    caches = {
        f"l{i}": raw[i * per_layer : (i + 1) * per_layer].view(torch.float32).view(n, 4, 32, 256)
        for i in range(args.layers)
    }
    layout = PageLayout.of(caches, n)
    w = WorkerSide(SidecarClient(sidecar.socket_url), layout, spec, 8, arena.holding(layout.views))
    try:
        times = []
        for _ in range(args.rounds + 1):
            t = time.perf_counter()
            w.load([Transfer("r", keys, blocks)])
            times.append(time.perf_counter() - t)
            assert not w.take_load_errors()
        mb = args.pages * layout.page_bytes / 1e6
        d = statistics.median(times[1:])
        print(
            f"KV cache in the memfd ({len(kv_chunks(layout, w.kv_buffer))} chunks a page): load {d * 1e3:.1f} ms "
            f"({mb / d / 1e3:.1f} GB/s, {plain / d:.2f}x the plain copy), the first one "
            f"{times[0] * 1e3:.1f} ms (the sidecar's page faults on its new mapping)"
        )
    finally:
        w.close()


if __name__ == "__main__":
    main()
