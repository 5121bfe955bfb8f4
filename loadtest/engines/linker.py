"""The kv-sidecar UnifiedCacheLinker beside the HiCache backend, on the same CPU pools.

    .venv-sglang/bin/python -m loadtest.engines.linker [--prompts 24] [--pages 8]

One MHA model geometry (8 layers, 8 KV heads x 128, bf16, 16-token pages: 512 KiB a page),
one sidecar process (`--no-file-tier`), for each path:

  linker   engine A: device pages -> staging memfd -> sidecar (SGLang's UnifiedRadixCache
           inserts, the linker offloads, `check_hicache_events` commits); engine B: match,
           init_load_back, batch start, the forward's layer waits, finish (loadtest/kit/sglang/linker.py).
  hicache  engine A: device pages -> its private host pool (HiCache L2, SGLang's
           MHATokenToKVPoolHost page_first in a memfd) -> sidecar (HiCacheController's
           `write_storage`, SidecarHiCacheStorage zero copy); engine B: `prefetch` from the
           sidecar into its host pool, then host -> device. SGLang's device<->host copies are
           GPU kernels (sgl_kernel), absent on a CPU: torch index copies stand in for them,
           the same kind of copy the linker makes into its staging slots.

Every buffer is touched before the clock starts (a fresh memfd's first write to each 4 KiB
page is a fault; an engine that has run a while has paid them). Pages per second count the
prompts' KV pages moved end to end (device to sidecar, sidecar
to device), one request at a time; medians of `--rounds` (each on a fresh sidecar, the two
paths alternating). Host bytes: what each instance allocates on the host
beside its device pool (linker: its staging memfd; HiCache: its L2 host pool, SGLang's default
`--hicache-ratio 2`), plus the sidecar's host pool, for 2 and 4 instances on one node.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str

from api.engine.client import SidecarClient
from loadtest.kit.procs import SidecarProcess, socket_path
from loadtest.kit.sglang import linker as lk
from loadtest.kit.sglang import pools as kit  # SGLang's CPU settings first

PAGE, LAYERS, HEADS, DIM = 16, 8, 8, 128
PAGE_BYTES = PAGE * LAYERS * 2 * HEADS * DIM * 2


def device_pool(tokens: int):
    return MHATokenToKVPool(
        size=tokens,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=LAYERS,
    )


def prompts(n: int, pages: int) -> list[list[int]]:
    return [list(range(100_000 * (i + 1), 100_000 * (i + 1) + pages * PAGE)) for i in range(n)]


# -- the linker path ---------------------------------------------------------------------
def linker_engine(url: str, tokens: int) -> lk.Engine:
    kv = device_pool(tokens)
    pools = (
        ReqToTokenPool(size=512, max_context_len=tokens, device="cpu", enable_memory_saver=False),
        kv,
        PagedTokenToKVPoolAllocator(tokens, PAGE, torch.bfloat16, "cpu", kv, need_sort=False),
    )
    return lk.engine(url, "kv", pools=pools, page=PAGE)


def bench_linker(url: str, work: list, tokens: int) -> dict:
    a, b = linker_engine(url, tokens), linker_engine(url, tokens)
    for eng in (a, b):
        eng.linker.stage.fill_(0)  # touched, as in an engine that has run a while
    try:
        ready = [lk.computed(a, t, seed=i)[2] for i, t in enumerate(work)]  # the forwards (untimed)
        start = time.perf_counter()
        for params in ready:
            a.cache.insert(params)
            a.cache.check_hicache_events()
        lk.settle(a)
        offload_s = time.perf_counter() - start
        start = time.perf_counter()
        for t in work:
            req, m = lk.match(b, t)
            got = lk.load(b, req)
            assert not got.failed and got.tokens == len(t), (got.failed, got.tokens)
        load_s = time.perf_counter() - start
        assert b.linker.stats["pages_loaded"] == sum(len(t) for t in work) // PAGE
        return {"offload_s": offload_s, "load_s": load_s, "staging_bytes": a.linker.staging.size}
    finally:
        a.close()
        b.close()


# -- the HiCache path on the same device pools ---------------------------------------------
def hicache_engine(url: str, tokens: int):
    dev = device_pool(tokens)
    host = MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        PAGE,
        "page_first",
        pin_memory=False,
        device="cpu",
        allocator_type=kit.host_allocator("shm"),
        device_capacity_tokens=dev.size,
        start_layer=0,
        end_layer=LAYERS,
    )
    allocator = PagedTokenToKVPoolAllocator(
        tokens, PAGE, torch.bfloat16, "cpu", dev, need_sort=False
    )
    cc = HiCacheController(
        allocator,
        host,
        PAGE,
        None,
        threading.Event(),
        storage_backend="dynamic",
        model_name=kit.MODEL,
        storage_backend_extra_config=kit.extra_config(url),
    )
    return dev, host, allocator, cc


def _u8(t: torch.Tensor):
    """A tensor's bytes as a numpy (rows, row bytes) array (no copy)."""
    return t.view(torch.uint8).reshape(t.shape[0], -1).numpy()


def to_host(dev, host, d_idx, h_idx) -> None:
    """Device -> host pool (page_first: token, layer, head, dim), what SGLang's GPU kernel
    does; numpy row copies, as the linker's staging copies on CPU."""
    d, h = d_idx.numpy(), h_idx.numpy()
    for side, layers in ((0, dev.k_buffer), (1, dev.v_buffer)):
        table = _u8(host.kv_buffer[side])
        row = table.shape[1] // LAYERS
        for layer, buf in enumerate(layers):
            table[h, layer * row : (layer + 1) * row] = _u8(buf)[d]


def to_device(dev, host, h_idx, d_idx) -> None:
    d, h = d_idx.numpy(), h_idx.numpy()
    for side, layers in ((0, dev.k_buffer), (1, dev.v_buffer)):
        table = _u8(host.kv_buffer[side])
        row = table.shape[1] // LAYERS
        for layer, buf in enumerate(layers):
            _u8(buf)[d] = table[h, layer * row : (layer + 1) * row]


def bench_hicache(url: str, work: list, tokens: int) -> dict:
    (a_dev, a_host, a_alloc, a_cc), (b_dev, b_host, b_alloc, b_cc) = (
        hicache_engine(url, tokens),
        hicache_engine(url, tokens),
    )
    for host in (a_host, b_host):
        host.kv_buffer.view(torch.uint8).view(-1).fill_(
            0
        )  # touched, as in an engine that has run a while
    try:
        slots = [a_alloc.alloc(len(t)) for t in work]
        for s in slots:
            for buf in (*a_dev.k_buffer, *a_dev.v_buffer):
                buf.view(torch.uint8).view(buf.shape[0], -1)[s] = 7
        start = time.perf_counter()
        ops = []
        for t, s in zip(work, slots, strict=True):
            h = a_host.alloc(len(t))
            to_host(a_dev, a_host, s, h)
            ops.append(
                a_cc.write_storage(h, t, get_storage_hash_str(t, None, page_size=PAGE), None)
            )
        for _ in ops:
            a_cc.ack_backup_queue.get(timeout=kit.TIMEOUT)
        offload_s = time.perf_counter() - start
        start = time.perf_counter()
        for i, t in enumerate(work):
            h, loaded, _ = kit.prefetch(b_cc, t, rid=f"r{i}")
            assert loaded == len(t), loaded
            to_device(b_dev, b_host, h, b_alloc.alloc(len(t)))
        load_s = time.perf_counter() - start
        return {
            "offload_s": offload_s,
            "load_s": load_s,
            "host_pool_bytes": a_host.kv_buffer.nbytes,
        }
    finally:
        a_cc.detach_storage_backend()
        b_cc.detach_storage_backend()


def one_round(name: str, fn, work: list, tokens: int, pool_mib: int) -> dict:
    """One path on a fresh sidecar process."""
    sidecar = SidecarProcess(
        "--host-pool", f"{pool_mib}MiB", "--no-file-tier", socket=socket_path()
    ).wait_ready()
    try:
        with kit.single_rank(), kit.host_budget():
            res = fn(sidecar.socket_url, work, tokens)
        pages = sum(len(t) for t in work) // PAGE
        res["offload_pages_s"], res["load_pages_s"] = (
            pages / res["offload_s"],
            pages / res["load_s"],
        )
        res["sidecar_pages"] = sum(
            ns["pages"]["host"]
            for ns in SidecarClient(sidecar.socket_url).stats()["namespaces"].values()
        )
        return res
    finally:
        sidecar.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--pages", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sidecar-pool-mib", type=int, default=512)
    args = ap.parse_args()
    work = prompts(args.prompts, args.pages)
    tokens = max(2048, args.prompts * args.pages * PAGE + PAGE)
    out = {"pages": args.prompts * args.pages, "page_bytes": PAGE_BYTES, "loadavg": os.getloadavg()}
    runs = {"linker": [], "hicache": []}
    for _ in range(args.rounds):  # the paths alternate, so both see the machine's load alike
        for name, fn in (("linker", bench_linker), ("hicache", bench_hicache)):
            runs[name].append(one_round(name, fn, work, tokens, args.sidecar_pool_mib))
    for name, rs in runs.items():
        out[name] = {
            **rs[-1],
            **{
                k: statistics.median(r[k] for r in rs)
                for k in ("offload_pages_s", "load_pages_s", "offload_s", "load_s")
            },
            "runs": [[round(r["offload_pages_s"]), round(r["load_pages_s"])] for r in rs],
        }
    pool = args.sidecar_pool_mib << 20
    out["host_bytes"] = {
        n: {
            "linker": pool + n * out["linker"]["staging_bytes"],
            "hicache": pool + n * out["hicache"]["host_pool_bytes"],
        }
        for n in (2, 4)
    }
    out["loadavg_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
