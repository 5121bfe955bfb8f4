"""SGLang 0.5.23's own pools and cache controllers on a CPU machine, for the adapter's tests.

Runs in `.venv-sglang` (`make test-sglang`). Nothing of SGLang is replaced; two settings make
it build on a CPU: host pools with `pin_memory=False, device="cpu"` (pinning would call
cudaHostRegister), and torchvision's `nms`/`qnms` op schemas defined before SGLang imports
torchvision (the index's torchvision is a CUDA build whose `_C.so` does not load here, and its
meta registrations then fail on those two ops). Host pools book against SGLang's own
`host_memory_budget_scope` (`host_budget`, around every test), not free RAM less a 10 GiB
reserve. Without SGLang the tests skip, or fail when KV_SIDECAR_REQUIRE_SGLANG is set (CI).

Pools: 64 device tokens, pages of P=4 tokens, 3 layers; the host pools hold twice that
(SGLang's `hicache_ratio`), 33 pages with SGLang's padding page. Their layouts (N tokens,
L layers, H heads, D dims; what `get_page_buffer_meta` gives per page):

    MHATokenToKVPoolHost.kv_buffer, [0] = K, [1] = V
      page_first         (2, N,   L, H, D)     page p: K rows pP..pP+P-1 | same in V   2 chunks
      page_first_direct  (2, N/P, L, P, H, D)  page p: K[p]              | V[p]        2 chunks
      page_head          (2, N/P, H, P, L, D)  page p: K[p]              | V[p]        2 chunks
      layer_first        (2, L, N, H, D)       page p: K[l] rows, V[l] rows, l = 0..L-1  2L chunks
    MLATokenToKVPoolHost   page_first (N, L, 1, dim): 1 chunk; layer_first (L, N, 1, dim): L
    MambaPoolHost          temporal (slots, layers, 1, ...) + conv (slots, layers, 1, ...),
                           a page = 1 slot, in separate allocations (inline, never one memfd)
"""

from __future__ import annotations

import json
import os
import queue
import threading

import pytest
import torch

try:
    _TV = torch.library.Library("torchvision", "DEF")
    _TV.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except RuntimeError:  # a torchvision that loads defines them itself
    _TV = None

try:
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheFile,  # noqa: F401 (re-exported: test_backend.py uses kit.HiCacheFile)
        HiCacheStorage,
        HiCacheStorageConfig,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.common import get_allocator_type
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
except ImportError as exc:
    if os.environ.get("KV_SIDECAR_REQUIRE_SGLANG"):
        raise RuntimeError(
            f"SGLang is required here (make test-sglang builds .venv-sglang): {exc}"
        ) from exc
    pytest.skip(
        f"SGLang is not installed ({exc}); make test-sglang runs these", allow_module_level=True
    )

P, LAYERS, TOKENS = 4, 3, 64
MODEL = "Qwen/Qwen3-8B"
MHA_LAYOUTS = ("page_first", "page_first_direct", "layer_first", "page_head")
TIMEOUT = 60  # seconds a controller queue may take to answer (a bound, not a wait)


def single_rank():
    """SGLang's parallel context for one rank without torch.distributed (its test kit's way)."""
    return get_parallel().override(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )


def host_budget():
    """SGLang's own host memory snapshot (`host_memory_budget_scope`, as its auto-sizer
    uses): pools book against 1 GiB instead of the machine's free RAM less SGLang's 10 GiB
    reserve, which on a shared or small machine is below zero and fails every host pool."""
    return host_memory_budget_scope(1 << 30)


# -- pools ------------------------------------------------------------------------------
def host_allocator(allocator: str) -> str:
    """The host allocator SGLang picks for our extra config with `"allocator": allocator`
    ("shm": a memfd; "": the key left out, SGLang's default), by its own get_allocator_type()
    over published server args, as when it builds the host pools."""
    extra = extra_config("", allocator=allocator)
    set_global_server_args_for_scheduler(
        ServerArgs(
            model_path="dummy",
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(extra),
        )
    )
    return get_allocator_type()


def mha(layout: str = "page_first", dtype=torch.bfloat16, allocator: str = "shm"):
    """(device pool, host pool): SGLang's MHATokenToKVPool and MHATokenToKVPoolHost."""
    dev = MHATokenToKVPool(
        size=TOKENS,
        page_size=P,
        dtype=dtype,
        head_num=2,
        head_dim=16,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=LAYERS,
    )
    host = MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        P,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=host_allocator(allocator),
        device_capacity_tokens=dev.size,
        start_layer=0,
        end_layer=LAYERS,
    )
    return dev, host


def mla(layout: str = "page_first", dtype=torch.bfloat16, allocator: str = "shm"):
    """(device pool, host pool): SGLang's MLATokenToKVPool and MLATokenToKVPoolHost."""
    dev = MLATokenToKVPool(
        size=TOKENS,
        page_size=P,
        dtype=dtype,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=LAYERS,
    )
    host = MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        P,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=host_allocator(allocator),
        device_capacity_tokens=dev.size,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
        override_kv_cache_dim=dev.kv_cache_dim,
    )
    return dev, host


def mamba(allocator: str = "shm", slots: int = 16):
    """(device pool, host pool): SGLang's MambaPool (Mamba2 state of 2 layers) and MambaPoolHost."""
    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=32,
        n_groups=1,
        num_heads=2,
        head_dim=8,
        state_size=4,
        conv_kernel=4,
    )
    dev = MambaPool(
        size=slots,
        spec_state_size=0,
        cache_params=Mamba2CacheParams(shape=shape, layers=[0, 1]),
        mamba_layer_ids=[0, 1],
        device="cpu",
    )
    host = MambaPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        device_capacity=dev.size,
        pin_memory=False,
        device="cpu",
        allocator_type=host_allocator(allocator),
        layout="page_first",
    )
    return dev, host


def swa(allocator: str = "shm"):
    """((full device, full host), (SWA device, SWA host)): SGLang's SWAKVPool (layer 0 full
    attention, layers 1-2 sliding window) and an MHATokenToKVPoolHost over each part."""
    pool = SWAKVPool(
        size=TOKENS,
        size_swa=TOKENS,
        page_size=P,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=16,
        swa_attention_layer_ids=[1, 2],
        full_attention_layer_ids=[0],
        device="cpu",
    )

    def host(dev):
        return MHATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            P,
            "page_first",
            pin_memory=False,
            device="cpu",
            allocator_type=host_allocator(allocator),
            device_capacity_tokens=dev.size,
            start_layer=dev.start_layer,
            end_layer=dev.end_layer,
        )

    return (pool.full_kv_pool, host(pool.full_kv_pool)), (pool.swa_kv_pool, host(pool.swa_kv_pool))


def randomize(host, seed: int = 0) -> None:
    """Random bytes in every buffer of a host pool (bit patterns, whatever the dtype)."""
    gen = torch.Generator().manual_seed(seed)
    buffers = (
        [host.temporal_buffer, *host.conv_buffer]
        if isinstance(host, MambaPoolHost)
        else [host.kv_buffer]
    )
    for buf in buffers:
        raw = buf.view(torch.uint8).view(-1)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def page_bytes(host, page: int) -> bytes:
    """One page's bytes in `get_data_page` order (compared as bytes: NaN patterns stay equal)."""
    return (
        host.get_data_page(page * host.page_size, flat=True)
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes()
    )


def indices(pages, page_size: int = P) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])


# -- the backend through SGLang's factory ------------------------------------------------
def extra_config(url: str, **kw) -> dict:
    """The documented extra config (docs/sglang.md), with overrides (allocator="" drops the key)."""
    extra = {
        "backend_name": "kv_sidecar",
        "module_path": "api.sglang_backend",
        "class_name": "SidecarHiCacheStorage",
        "interface_v1": 1,
        "allocator": "shm",
        "sidecar_url": url,
        **kw,
    }
    if not extra["allocator"]:
        del extra["allocator"]
    return extra


def storage_config(
    url: str, tp=0, tp_size=1, mla=False, model=MODEL, **extra
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config=extra_config(url, **extra),
    )


def dynamic_backend(cfg):
    """`--hicache-storage-backend dynamic`: SGLang's factory imports and constructs it."""
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert isinstance(backend, HiCacheStorage)
    return backend


# -- SGLang's cache controllers, driven as its scheduler drives them ---------------------
def hicache_controller(url: str, dev, host, **extra) -> HiCacheController:
    """HiCacheController over one KV pool, attaching the backend with storage_backend="dynamic"."""
    allocator = PagedTokenToKVPoolAllocator(TOKENS, P, dev.dtype, "cpu", dev, need_sort=False)
    return HiCacheController(
        allocator,
        host,
        P,
        None,
        threading.Event(),
        storage_backend="dynamic",
        model_name=MODEL,
        storage_backend_extra_config=extra_config(url, **extra),
    )


def hybrid_controller(url: str, kv, extras: dict, **extra) -> HybridCacheController:
    """HybridCacheController over a HostPoolGroup: KV (the anchor) and `extras`, each
    {PoolName: (device pool, host pool)} (Mamba state, SWA KV)."""
    kv_dev, kv_host = kv
    entries = [
        PoolEntry(
            name=PoolName.KV,
            host_pool=kv_host,
            device_pool=kv_dev,
            layer_mapper=lambda i: i,
            is_primary_index_anchor=True,
        )
    ]
    entries += [
        PoolEntry(name=name, host_pool=host, device_pool=dev, layer_mapper=lambda i: None)
        for name, (dev, host) in extras.items()
    ]
    allocator = PagedTokenToKVPoolAllocator(TOKENS, P, kv_dev.dtype, "cpu", kv_dev, need_sort=False)
    return HybridCacheController(
        allocator,
        HostPoolGroup(entries),
        P,
        None,
        threading.Event(),
        storage_backend="dynamic",
        model_name=MODEL,
        storage_backend_extra_config=extra_config(url, **extra),
    )


def hashes(tokens) -> list[str]:
    """SGLang's own page keys for a token sequence (from the root)."""
    return get_storage_hash_str(list(tokens), None, page_size=P)


def mamba_trailing(host_indices=None, key="__placeholder__") -> PoolTransfer:
    """The Mamba component's transfer: one state, at the trailing page."""
    return PoolTransfer(
        name=PoolName.MAMBA,
        host_indices=host_indices,
        keys=[key],
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )


def swa_trailing(host_indices=None, keys=("__placeholder__",) * 2) -> PoolTransfer:
    """The SWA component's transfer: the window's trailing pages (2 here)."""
    return PoolTransfer(
        name=PoolName.SWA,
        host_indices=host_indices,
        keys=list(keys),
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )


def write_back(cc, host_indices, tokens, extra_pools=None):
    """Write-back to storage: `write_storage`, then the backup thread's ack (as the tree cache)."""
    kw = {"extra_pools": extra_pools} if extra_pools else {}
    op_id = cc.write_storage(host_indices, list(tokens), hashes(tokens), None, **kw)
    op = cc.ack_backup_queue.get(timeout=TIMEOUT)
    assert op.id == op_id
    return op


def prefetch(cc, tokens, extra_pools=None, rid="r"):
    """Prefetch from storage as the scheduler does: the prefetch thread's hit query, host
    buffers for the hit (KV from the controller, each extra pool's trailing slots from its
    own host pool), the I/O thread's transfer, the acks. Returns (KV host indices, tokens
    loaded, pool hits of the last ack)."""
    if isinstance(cc, HybridCacheController):
        cc.prefetch(CacheRequestHandle(rid, 0), list(tokens), None, None, extra_pools=extra_pools)
    else:
        cc.prefetch(rid, list(tokens), None)
    op = cc.prefetch_hit_queue.get(timeout=TIMEOUT)
    if op.storage_hit_count == 0:
        return torch.empty(0, dtype=torch.int64), 0, {}
    host_indices = cc.alloc_prefetch_host_buffers(op, op.storage_hit_count)
    assert host_indices is not None
    for t in extra_pools or []:
        entry = cc.mem_pool_host.entry_map[t.name]
        t.host_indices = entry.host_pool.alloc(len(t.keys) * entry.host_pool.page_size)
    op.host_indices = host_indices
    cc.prefetch_buffer.put(op)
    loaded, pool_hits = 0, {}
    while True:
        try:
            ack = cc.ack_prefetch_queue.get(timeout=TIMEOUT)
        except queue.Empty:
            raise AssertionError("the controller's prefetch never completed") from None
        if ack.completed_tokens is not None:
            loaded = ack.completed_tokens
        pool_hits = getattr(ack, "pool_hits", None) or pool_hits
        if ack.completed_req:
            return host_indices, loaded, pool_hits
