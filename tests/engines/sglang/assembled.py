"""Whole host pool stacks built by SGLang 0.5.23's own assemblers on a CPU, for the tests of
the DSA indexer, DeepSeek-V4 and draft pools (kit.py builds single pools by hand).

The stacks come from `hybrid_pool_assembler`'s strategies (`_DsaStrategy`,
`_DeepSeekV4Strategy`, `_PlainKvStrategy`, `_SwaStrategy`) and draft sidecars from
`build_hicache_draft_sidecars`, each with its `HybridCacheController` attached to the backend
through `storage_backend="dynamic"`. The tree's two sidecar steps are restated here, line for
line, because `UnifiedRadixCache` does not import in .venv-sglang (its session module pulls
in the OpenAI protocol package, which the Makefile does not install):
`register_sidecar_pool` (the controller's `register_host_pool_entry`, then the spec is kept)
and `_build_sidecar_transfers` (one transfer a spec, keys and indices from its source).

Replaced, GPU-only, nothing else:
- `pool_host.common._cuda_host_register` is a no-op: the assemblers build host pools with
  SGLang's default `pin_memory=True`, which page-locks them with cudaHostRegister for DMA;
  CPU torch has no CUDA runtime (`torch.cuda.cudart()` raises). Bytes, layout and the memfd
  stay SGLang's own.
- the radix tree (`UnifiedRadixCache`) is not built; the strategies read only its component
  set and eviction callbacks (never called here), and the tests take the tree's steps.

Page layouts (page_first; P tokens a page; what one host page holds):

    DSA, P=64, 2 layers (+1 packed MTP layer per draft)
      kv       MLATokenToKVPoolHost (N, L, 1, 48) bf16         L x 64 x 96 B   = 12288 (L=2)
      indexer  DSAIndexerPoolHost   (N/P+1, L, 1, 64 x 132) u8 L x 8448 B     = 16896 (L=2)
    DeepSeek-V4, P=256, layers (ratio) 0:SWA-only 1:C4 2:C128 3:C2 source 4:C1 source
      kv                 LogicalHostPool: no bytes; 512-byte marker pages in the sidecar
      swa                (pages, 5, 149760)  5 layers of 256 tokens x 584 B, padded to 576s
      deepseek_v4_c4     (pages, 1, 37440)   64 compressed tokens x 584 B, padded
      deepseek_v4_c4_indexer (pages, 1, 8448)  64 x (128 + 4) B
      deepseek_v4_c4_state / _indexer_state  (pages, 1, 65536 / 16384): ring of 8 fp32 rows
      deepseek_v4_c128   (pages, 1, 1728)    2 compressed tokens, padded
      deepseek_v4_c1 / c2 (pages, 1, 149760 / 74880), c1 / c2 _indexer (17408 / 8704)
    DeepSeek-V4 unified fp8 (ROCm's layout), P=256, layers 0:SWA-only 1:C4 2:C128
      deepseek_v4_c4 / _rope   64 rows x 512 B fp8 nope / 64 x 128 B bf16 rope
      deepseek_v4_c128 / _rope 2 x 512 B / 2 x 128 B = 256 B: stored padded to 512, inline
    Draft tests, P=16 (pages of 1-layer drafts must reach the sidecar's 512 B minimum)
      kv / draft  MLATokenToKVPoolHost (N, L, 1, 48) bf16: L x 1536 B; MHA (2, N, L, 2, 16): L x 2048 B
      swa / draft_swa  MHATokenToKVPoolHost over SWAKVPool's halves
"""

from __future__ import annotations

import json
import queue
import threading
from types import SimpleNamespace
from typing import NamedTuple

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host import common as host_common
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.base import CacheTransferPhase
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from loadtest.kit.sglang import pools as kit
from loadtest.kit.sglang.pools import CacheRequestHandle, PoolHitPolicy, PoolName, PoolTransfer

DSA_P, DSA_TOKENS = 64, 64 * 8
V4_P, V4_FULL, V4_SWA = 256, 256 * 8, 256 * 4  # SGLang hardcodes DeepSeek-V4's page at 256
V4_RATIOS = [0, 4, 128, 2, 1]  # every compressed pool kind the CUDA path builds
SMALL_P, SMALL_TOKENS = 16, 16 * 8  # MLA / MHA / SWA stacks for the draft tests


def _no_pinning(buffer, registration_granularity_bytes=None) -> None:
    """cudaHostRegister stand-in (GPU-only: page-locks host memory for DMA)."""


def unpin() -> None:
    """The same replacement for a whole engine process (engine_proc-style children)."""
    host_common._cuda_host_register = _no_pinning


class Stack(NamedTuple):
    cc: object  # HybridCacheController
    group: object  # HostPoolGroup
    specs: list  # the SidecarPoolSpecs the strategy returned (the tree registers them)
    device: object  # the device KV pool


# -- assembling --------------------------------------------------------------------------
def publish(extra: dict) -> None:
    """The server args the assemblers read (get_memory()): page_first host pools, ratio 2,
    the dynamic backend with our extra config (so SGLang picks the shm allocator)."""
    set_global_server_args_for_scheduler(
        ServerArgs(
            model_path="dummy",
            hicache_storage_backend="dynamic",
            hicache_mem_layout="page_first",
            hicache_ratio=2.0,
            hicache_storage_backend_extra_config=json.dumps(extra),
        )
    )


def assemble(strategy, kvcache, params, url: str, **extra) -> Stack:
    """`strategy.build(...)` as attach_hybrid_pool_to_unified_cache calls it."""
    cfg = kit.extra_config(url, **extra)
    publish(cfg)
    tree = SimpleNamespace(
        components={ComponentType.FULL: None, ComponentType.SWA: None},
        evict_host=lambda n, component=None: 0,
    )
    res = strategy.build(
        cache=tree,
        kvcache=kvcache,
        params=params,
        server_args=None,
        load_cache_event=threading.Event(),
        storage_backend="dynamic",
        storage_backend_extra_config=dict(cfg),
        model_name=kit.MODEL,
    )
    return Stack(res.cache_controller, res.host_pool_group, list(res.sidecars), kvcache)


def dsa_pool(layers: int):
    """SGLang's DSATokenToKVPool: MLA KV (rank 32 + rope 16) and the FP8 index keys."""
    return DSATokenToKVPool(
        size=DSA_TOKENS,
        page_size=DSA_P,
        kv_lora_rank=32,
        dtype=torch.bfloat16,
        qk_rope_head_dim=16,
        layer_num=layers,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=48,
    )


def dsa_stack(url: str, drafts: int = 0, **extra) -> Stack:
    """`_DsaStrategy`: KV + indexer, MTP draft layers packed into both host pools."""
    dev = dsa_pool(2)
    alloc = PagedTokenToKVPoolAllocator(DSA_TOKENS, DSA_P, dev.dtype, "cpu", dev, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=alloc,
        page_size=DSA_P,
        mtp_draft_device_pools=tuple(dsa_pool(1) for _ in range(drafts)),
    )
    return assemble(hpa._DsaStrategy(), dev, params, url, **extra)


def v4_pool(ratios=V4_RATIOS, draft: bool = False, unified: bool = False):
    """SGLang's DeepSeekV4TokenToKVPool (V4 layout: 448 fp8 nope + 64 bf16 rope a token;
    `unified`: the fp8 unified_kv layout, nope and rope in two pools)."""
    sources = [i for i, r in enumerate(ratios) if r in (1, 2)]
    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4,
        swa_size=V4_SWA,
        c4_size=V4_FULL // 4,
        c128_size=V4_FULL // 128,
        c4_state_pool_size=V4_SWA,
        c128_state_pool_size=4,
        page_size=V4_P,
        swa_page_size=V4_P,
        dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32,
        qk_nope_head_dim=448,
        qk_rope_head_dim=64,
        indexer_head_dim=128,
        layer_num=len(ratios),
        device="cpu",
        enable_memory_saver=False,
        compression_ratios=list(ratios),
        sliding_window=128,
        start_layer=0,
        end_layer=len(ratios),
        kv_source_layers=sources,
        full_size=V4_FULL,
        is_draft_worker=draft,
        unified_fp8=unified,
    )


def v4_stack(url: str, unified: bool = False, **extra) -> Stack:
    """`_DeepSeekV4Strategy`: a logical KV anchor, paged SWA, every compressed pool; with
    `unified` (fp8 unified_kv: no paged SWA, no low ratios) the C4 / C128 rope pools instead."""
    publish(kit.extra_config(url, **extra))  # the device pool reads the published config too
    dev = v4_pool([0, 4, 128], unified=True) if unified else v4_pool()
    alloc = (
        PagedTokenToKVPoolAllocator(V4_FULL, V4_P, dev.dtype, "cpu", dev, need_sort=False)
        if unified
        else SWATokenToKVPoolAllocator(
            V4_FULL, V4_SWA, V4_P, dev.dtype, "cpu", dev, need_sort=False
        )
    )
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=V4_P
    )
    return assemble(hpa._DeepSeekV4Strategy(), dev, params, url, **extra)


def mla_pool(layers: int):
    """SGLang's MLATokenToKVPool, pages of 16 tokens (a 1-layer draft page: 1536 B)."""
    return MLATokenToKVPool(
        size=SMALL_TOKENS,
        page_size=SMALL_P,
        dtype=torch.bfloat16,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=layers,
    )


def mha_pool(layers: int):
    """SGLang's MHATokenToKVPool, 2 heads of 16, pages of 16 tokens (1 layer: 2048 B)."""
    return MHATokenToKVPool(
        size=SMALL_TOKENS,
        page_size=SMALL_P,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=16,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=layers,
    )


def plain_stack(url: str, target, **extra) -> Stack:
    """`_PlainKvStrategy` over an MLA or MHA device pool (build_kv_only_stack)."""
    publish(kit.extra_config(url, **extra))
    alloc = PagedTokenToKVPoolAllocator(
        target.size, target.page_size, target.dtype, "cpu", target, need_sort=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=alloc,
        page_size=target.page_size,
    )
    return assemble(hpa._PlainKvStrategy(), target, params, url, **extra)


def swa_pool(swa_layers, full_layers):
    """SGLang's SWAKVPool (MHA halves, pages of 16 tokens)."""
    return SWAKVPool(
        size=SMALL_TOKENS,
        size_swa=SMALL_TOKENS,
        page_size=SMALL_P,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=16,
        swa_attention_layer_ids=list(swa_layers),
        full_attention_layer_ids=list(full_layers),
        device="cpu",
    )


def swa_stack(url: str, mtp_draft=None, tp_group=None, **extra) -> Stack:
    """`_SwaStrategy` (build_hybrid_swa_stack); an MTP draft whose SWA layer uses full-token
    indices gets its own DRAFT_SWA host pool and `_mtp_swa_sidecar_specs`' spec. `tp_group`:
    the TP process group the controller reduces hits over (None: one rank)."""
    publish(kit.extra_config(url, **extra))
    target = swa_pool([1, 2], [0])
    alloc = SWATokenToKVPoolAllocator(
        SMALL_TOKENS, SMALL_TOKENS, SMALL_P, target.dtype, "cpu", target, need_sort=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=alloc,
        page_size=SMALL_P,
        mtp_draft_device_pools=(mtp_draft,) if mtp_draft else (),
        tp_cache_group=tp_group,
    )
    return assemble(hpa._SwaStrategy(), target, params, url, **extra)


def add_draft_sidecars(stack: Stack, draft_pool) -> Stack:
    """`build_hicache_draft_sidecars` + `UnifiedRadixCache.register_sidecar_pool`, as
    kv_cache_builder registers draft pools once the target's cache is attached."""
    tree = SimpleNamespace(cache_controller=stack.cc)
    specs, entries = hpa.build_hicache_draft_sidecars(
        draft_device_pools=(draft_pool,), tree_cache=tree
    )
    for entry in entries:  # UnifiedRadixCache.register_sidecar_pool
        stack.cc.register_host_pool_entry(entry)
    return stack._replace(specs=stack.specs + list(specs))


def tp_rank(rank: int, size: int):
    """SGLang's parallel context for TP rank `rank` of `size` (a controller takes its storage
    config from it when it attaches the backend)."""
    return kit.get_parallel().override(
        tp_rank=rank,
        tp_size=size,
        attn_tp_rank=rank,
        attn_tp_size=size,
        moe_tp_size=size,
        moe_tp_rank=rank,
        pp_rank=0,
        pp_size=1,
        attn_dcp_size=1,
        attn_dcp_rank=0,
    )


# -- contents ------------------------------------------------------------------------------
def fill(host, seed: int) -> None:
    """Random bytes in every buffer a host pool owns (any of SGLang's host pool classes)."""
    gen = torch.Generator().manual_seed(seed)
    for attr in ("kv_buffer", "index_k_with_scale_buffer"):
        bufs = getattr(host, attr, None)
        for buf in bufs if isinstance(bufs, (list, tuple)) else [bufs]:
            if buf is None:
                continue
            raw = buf.view(torch.uint8).reshape(-1)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def fill_all(stack: Stack, seed: int) -> None:
    for i, entry in enumerate(stack.group.entries):
        fill(entry.host_pool, seed * 100 + i)


def pages_of(host_indices, page: int) -> list[int]:
    return [int(i) // page for i in host_indices[::page]]


def hashes(tokens, page: int) -> list[str]:
    return get_storage_hash_str(list(tokens), None, page_size=page)


def trailing(name, host_indices=None, keys=("__placeholder__",) * 2):
    """A component's window transfer (SWA: the last pages of the span)."""
    return PoolTransfer(
        name=name,
        host_indices=host_indices,
        keys=list(keys),
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )


def sidecar_transfers(specs, phase, kv_xfer, comp) -> list:
    """The tree's sidecar transfers for `specs` (UnifiedRadixCache._build_sidecar_transfers):
    keys from the source (KV, or the SWA / Mamba component), indices resolved later by the
    controller; a backup skips a spec whose source has no indices."""
    out = []
    for spec in specs:
        source = (
            kv_xfer
            if spec.indices_from_pool == PoolName.KV
            else next((t for t in comp if t.name == spec.indices_from_pool), None)
        )
        if source is None:
            continue
        indices = (
            source.device_indices
            if phase == CacheTransferPhase.BACKUP_HOST
            else source.host_indices
        )
        if (indices is None or len(indices) == 0) and phase != CacheTransferPhase.PREFETCH:
            continue
        out.append(
            PoolTransfer(
                name=spec.pool_name,
                keys=source.keys,
                hit_policy=spec.hit_policy,
                indices_from_pool=spec.indices_from_pool,
            )
        )
    return out


def presence(stack: Stack, name, keys) -> list[bool]:
    """Which of `keys` the sidecar holds for pool `name` (ground truth for the rule)."""
    backend = stack.cc.storage_backend
    return backend.client.exists_each(backend.bindings[str(name)].namespace, list(keys))


def brute_force(kv: list[bool], pools) -> list[int]:
    """Every endpoint e (pages [0, e) restored) legal for all pools, by enumeration: KV on
    [0, e); an all_pages pool on [0, e); a trailing_pages pool of window w on [e - w, e).
    `pools`: (present, policy, window) each."""
    legal = []
    for e in range(1, len(kv) + 1):
        if not all(kv[:e]):
            break
        if all(
            all(p[:e]) if pol == PoolHitPolicy.ALL_PAGES else all(p[max(0, e - w) : e])
            for p, pol, w in pools
        ):
            legal.append(e)
    return legal


# -- moving pages as the scheduler does ------------------------------------------------------
def write_back(stack: Stack, host_indices, tokens, comp=()):
    """`write_storage` with the component and sidecar transfers the tree builds for a node,
    then the backup thread's ack."""
    P = stack.cc.page_size
    keys = hashes(tokens, P)
    kv = PoolTransfer(name=PoolName.KV, host_indices=host_indices, keys=keys)
    extra = list(comp) + sidecar_transfers(stack.specs, CacheTransferPhase.BACKUP_STORAGE, kv, comp)
    op_id = stack.cc.write_storage(
        host_indices, list(tokens), keys, None, extra_pools=extra or None
    )
    op = stack.cc.ack_backup_queue.get(timeout=kit.TIMEOUT)
    assert op.id == op_id
    return op


class Prefetched(NamedTuple):
    host_indices: torch.Tensor  # KV (anchor) slots; KV-derived sidecars use the same
    loaded: int  # tokens, after the controller's acks
    pool_hits: dict  # the last ack's per-pool pages
    op: object  # the PrefetchOperation (hit, per-pool verdicts)
    comp: list  # the component transfers with the slots they loaded into


def prefetch(stack: Stack, tokens, comp=(), extra=(), rid: str = "r") -> Prefetched:
    """The tree's prefetch: hit query (prefetch thread), the KV bounce via
    `allocate_storage_hit`, each component's window slots (as `_alloc_prefetch_aux_staging`),
    the I/O thread, the acks. `extra`: more transfers for the hit query (a BLOCK_GROUPS pool)."""
    cc, P = stack.cc, stack.cc.page_size
    kv = PoolTransfer(name=PoolName.KV, host_indices=None)
    comp = list(comp)
    transfers = (
        comp + sidecar_transfers(stack.specs, CacheTransferPhase.PREFETCH, kv, comp) + list(extra)
    )
    cc.prefetch(CacheRequestHandle(rid, 0), list(tokens), None, None, extra_pools=transfers or None)
    op = cc.prefetch_hit_queue.get(timeout=kit.TIMEOUT)
    if op.storage_hit_count == 0:
        return Prefetched(torch.empty(0, dtype=torch.int64), 0, {}, op, comp)
    host_indices, _ = cc.allocate_storage_hit(
        op, op.storage_hit_count, allow_partial=False, min_tokens=P, evict_host=lambda n: 0
    )
    assert host_indices is not None
    for t in comp:
        host = cc.mem_pool_host.entry_map[t.name].host_pool
        t.host_indices = host.alloc(min(len(t.keys), op.storage_hit_count // P) * host.page_size)
    op.host_indices = host_indices
    cc.prefetch_buffer.put(op)
    loaded, hits = _acks(cc)
    return Prefetched(host_indices, loaded, hits, op, comp)


def _acks(cc) -> tuple[int, dict]:
    loaded, hits = 0, {}
    while True:
        try:
            ack = cc.ack_prefetch_queue.get(timeout=kit.TIMEOUT)
        except queue.Empty:
            raise AssertionError("the controller's prefetch never completed") from None
        if ack.completed_tokens is not None:
            loaded = ack.completed_tokens
        hits = getattr(ack, "pool_hits", None) or hits
        if ack.completed_req:
            return loaded, hits
