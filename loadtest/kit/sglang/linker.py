"""SGLang 0.5.23's UnifiedRadixCache with the kv-sidecar linker, on CPU device pools.

An `Engine` is what one SGLang scheduler process holds for its cache: the device pools
(`MHATokenToKVPool`, `SWAKVPool`, `HybridLinearKVPool` + `HybridReqToTokenPool`'s
`MambaPool`, on `device="cpu"`), a `PagedTokenToKVPoolAllocator` (or SGLang's SWA
allocator), and the tree made by SGLang's own `registry.create_tree_cache` from published
`ServerArgs` with `--enable-unified-cache-external-linker --unified-cache-external-linker-
backend dynamic` and the documented config: SGLang's `linker_factory` imports and builds
`api.sglang_linker.SidecarLinker` and its `UnifiedCacheLinkerWrapper` drives it.

The scheduler's steps are taken here in its order (sglang/srt/managers/scheduler.py):
`check_hicache_events` each step (offload completions), `match_prefix` with the request
(the linker's lookup), `init_load_back` (its load), `ready_to_load_host_cache` at batch
start, `TpModelWorker.set_hicache_consumer` and the forward's per-layer waits (the KV
pools' own `get_key_buffer`), `finish_external_linker_loads` after the forward, `insert`
when a request's KV is cached (write-through: the linker's offload).

Replaced, with the reason: the model worker (`TpModelWorker`: a model and a GPU) by
`Worker`, which keeps the layer counter and sets its consumer exactly as SGLang's does;
the forward by reading every layer's KV buffer through the pools (what attention does
first). Requires `openai` and `partial-json-parser` in .venv-sglang: SGLang's
`UnifiedRadixCache` imports its request classes, which import its OpenAI protocol.

Pools (P = 4 tokens a page, bf16, 2 heads x 16 dims): KV 3 layers (1,536-byte pages);
SWA: layer 0 full, 1-2 sliding window of 8 tokens (2 pages); Mamba: layer 0 full attention,
layers 1-2 Mamba2 state (one state slot a node).
"""

from __future__ import annotations

import hashlib
import os
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from loadtest.kit.sglang import pools as kit  # noqa: F401  (SGLang's CPU settings: torchvision op schemas) first

try:  # UnifiedRadixCache's request classes import SGLang's OpenAI protocol
    from sglang.srt.managers.schedule_batch import Req
except ImportError as exc:
    if os.environ.get("KV_SIDECAR_REQUIRE_SGLANG"):
        raise RuntimeError(
            f"SGLang's UnifiedRadixCache needs openai==2.8.0 and partial-json-parser in "
            f".venv-sglang: {exc}"
        ) from exc
    pytest.skip(f"SGLang's request classes do not import ({exc})", allow_module_level=True)
from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE as FLA_CHUNK_SIZE
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import (
    HybridLinearKVPool,
    HybridReqToTokenPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

P, LAYERS, TOKENS, WINDOW = 4, 3, 128, 8


def linker_config(url: str, **extra) -> dict:
    """The documented `--unified-cache-external-linker-config` (docs/sglang.md)."""
    return {
        "linker": "SidecarLinker",
        "linker_module_path": "api.sglang_linker",
        "linker_extra_config": {"sidecar_url": url, **extra},
    }


def publish(url: str, kind: str, page: int = P, **extra) -> ServerArgs:
    """Server args as the launcher publishes them to the scheduler (SGLang's own resolution)."""
    args = ServerArgs(
        model_path="dummy",
        page_size=page,
        enable_unified_cache_external_linker=True,
        unified_cache_external_linker_backend="dynamic",
        unified_cache_external_linker_config=linker_config(url, **extra),
    )
    args._mamba_cache_chunk_size = max(FLA_CHUNK_SIZE, page)  # what the HF config would give
    set_global_server_args_for_scheduler(args)
    return args


class Worker:
    """Stands in for SGLang's TpModelWorker (it needs a model and a GPU): the two methods the
    cache uses, as SGLang writes them, and the forward's reads of the KV pools."""

    def __init__(self):
        self.hicache_layer_transfer_counter = None
        self.model_runner = type("ModelRunner", (), {"forward_stream": None})()

    def register_hicache_layer_transfer_counter(self, counter) -> None:
        self.hicache_layer_transfer_counter = counter

    def set_hicache_consumer(self, consumer_index: int) -> None:
        if self.hicache_layer_transfer_counter is not None:
            self.hicache_layer_transfer_counter.set_consumer(consumer_index)


@dataclass
class Engine:
    kind: str
    cache: Any
    allocator: Any
    req_to_token_pool: Any
    kvcache: Any
    worker: Worker
    rids: list = field(default_factory=list)

    @property
    def linker(self):
        return self.cache.linker.cache_linker

    def close(self) -> None:
        self.cache.release_host_resources()


def _pools(kind: str):
    """(req_to_token_pool, kvcache, allocator) as SGLang's own unit-test fixture builds them."""
    if kind in ("mamba", "mla_mamba"):
        shape = Mamba2StateShape.create(
            tp_world_size=1,
            intermediate_size=32,
            n_groups=1,
            num_heads=2,
            head_dim=8,
            state_size=4,
            conv_kernel=4,
        )
        rtp = HybridReqToTokenPool(
            size=8,
            mamba_size=24,
            mamba_spec_state_size=8,
            max_context_len=TOKENS,
            device="cpu",
            enable_memory_saver=False,
            cache_params=Mamba2CacheParams(shape=shape, layers=[1, 2]),
            mamba_layer_ids=[1, 2],
            enable_mamba_extra_buffer=True,
            speculative_num_draft_tokens=3,
        )
        mla = (
            {"use_mla": True, "kv_lora_rank": 32, "qk_rope_head_dim": 16}
            if kind == "mla_mamba"
            else {}
        )
        kv = HybridLinearKVPool(
            size=TOKENS,
            dtype=torch.bfloat16,
            page_size=P,
            head_num=2,
            head_dim=16,
            full_attention_layer_ids=[0],
            device="cpu",
            enable_memory_saver=False,
            mamba_pool=rtp.mamba_pool,
            **mla,
        )
        return (
            rtp,
            kv,
            PagedTokenToKVPoolAllocator(TOKENS, P, torch.bfloat16, "cpu", kv, need_sort=False),
        )
    rtp = ReqToTokenPool(size=8, max_context_len=TOKENS, device="cpu", enable_memory_saver=False)
    if kind == "swa":
        kv = SWAKVPool(
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
        return (
            rtp,
            kv,
            SWATokenToKVPoolAllocator(
                size=TOKENS,
                size_swa=TOKENS,
                page_size=P,
                dtype=torch.bfloat16,
                device="cpu",
                kvcache=kv,
                need_sort=False,
            ),
        )
    if kind == "mla":
        kv = MLATokenToKVPool(
            size=TOKENS,
            page_size=P,
            dtype=torch.bfloat16,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
            start_layer=0,
            end_layer=LAYERS,
        )
    else:
        kv = MHATokenToKVPool(
            size=TOKENS,
            page_size=P,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=16,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
            start_layer=0,
            end_layer=LAYERS,
        )
    return (
        rtp,
        kv,
        PagedTokenToKVPoolAllocator(TOKENS, P, torch.bfloat16, "cpu", kv, need_sort=False),
    )


def engine(
    url: str,
    kind: str = "kv",
    tp_group=None,
    tp: tuple[int, int] = (0, 1),
    pools=None,
    page: int = P,
    **extra,
) -> Engine:
    """One engine's tree cache through SGLang's `create_tree_cache`, the linker attached
    (`pools`: (req_to_token_pool, kvcache, allocator) of another geometry, pages of `page`)."""
    args = publish(url, kind, page, **extra)
    rtp, kv, allocator = pools or _pools(kind)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=rtp,
        token_to_kv_pool_allocator=allocator,
        page_size=page,
        tp_cache_group=tp_group,
        enable_mamba_extra_buffer="mamba" in kind,
        sliding_window_size=WINDOW if kind == "swa" else None,
    )
    worker = Worker()
    ctx = TreeCacheBuildContext(
        server_args=args,
        params=params,
        is_hybrid_swa=kind == "swa",
        is_hybrid_ssm="mamba" in kind,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=worker,
        model_config=None,
        tp_size=tp[1],
        tp_rank=tp[0],
        tp_group=tp_group,
    )
    cache = create_tree_cache(ctx)
    return Engine(kind, cache, allocator, rtp, kv, worker)


# -- requests -----------------------------------------------------------------------------
def request(eng: Engine, tokens) -> Req:
    req = Req(
        rid=f"{eng.kind}-{len(eng.rids)}",
        origin_input_text="",
        origin_input_ids=array("q", tokens),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
    )
    eng.rids.append(req.rid)
    eng.req_to_token_pool.alloc([req])
    return req


def _alloc(eng: Engine, n: int) -> torch.Tensor:
    """Device slots for n tokens (the SWA allocator's paged alloc needs batch tensors: its
    core steps, as SGLang's fixture takes them)."""
    if eng.kind != "swa":
        return eng.allocator.alloc(n)
    full = eng.allocator.full_attn_allocator.alloc(n)
    swa = eng.allocator.swa_attn_allocator.alloc(n)
    eng.allocator.full_to_swa_index_mapping[full] = swa
    return full


def compute(eng: Engine, tokens, seed: int):
    """A request whose forward filled its KV (and Mamba state) with seeded bytes, inserted
    into the tree as `cache_finished_req` does: the write-through offload is queued."""
    req, slots, params = computed(eng, tokens, seed)
    eng.cache.insert(params)
    return req, slots


def computed(eng: Engine, tokens, seed: int):
    """(request, device slots, its InsertParams) after a forward that wrote seeded bytes."""
    req = request(eng, tokens)
    slots = _alloc(eng, len(tokens))
    gen = torch.Generator().manual_seed(seed)
    for buf in kv_buffers(eng):
        rows = buf.view(torch.uint8).view(buf.shape[0], -1)
        rows[slots] = torch.randint(
            0, 256, (len(slots), rows.shape[1]), dtype=torch.uint8, generator=gen
        )
    params = InsertParams(key=RadixKey(array("q", tokens)), value=slots)
    if "mamba" in eng.kind:
        state = req.kv.mamba_pool_idx.unsqueeze(0)
        for buf in mamba_buffers(eng):
            row = buf.view(torch.uint8).view(buf.shape[0], -1)
            row[state] = torch.randint(0, 256, (1, row.shape[1]), dtype=torch.uint8, generator=gen)
        params.mamba_value = state
    return req, slots, params


def settle(eng: Engine, timeout: float = 60.0) -> None:
    """Scheduler steps (`check_hicache_events`) until every queued offload is committed."""
    deadline = time.monotonic() + timeout
    while eng.cache.linker.pending_offloads:
        eng.cache.check_hicache_events()
        if time.monotonic() > deadline:
            raise AssertionError("offloads never completed")
        time.sleep(0.002)


def match(eng: Engine, tokens):
    """The scheduler's match for a new request (the linker's lookup runs here)."""
    req = request(eng, tokens)
    m = eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
    req.prefix_len, req.last_node = m.device_prefix_len, m.last_device_node
    req.last_host_node, req.best_match_node = m.last_host_node, m.best_match_node
    req.host_hit_length, req.swa_host_hit_length = m.host_hit_length, m.swa_host_hit_length
    req.mamba_host_hit_length = m.mamba_host_hit_length
    return req, m


@dataclass
class Loaded:
    req: Any
    tokens: int  # what init_load_back reported
    slots: torch.Tensor | None  # the request's private device slots
    failed: list  # what finish_external_linker_loads reported


def load(eng: Engine, req, between=None) -> Loaded:
    """init_load_back, batch start, the forward's layer waits, finish (scheduler order);
    `between()` runs after init_load_back, before the batch starts."""
    n, _ = eng.cache.init_load_back(
        InitLoadBackParams(
            best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req
        )
    )
    slots = eng.cache.linker.private_load_indices.get(req.rid)
    if between is not None:
        between()
    index = eng.cache.ready_to_load_host_cache()
    eng.worker.set_hicache_consumer(index)
    forward(eng)
    failed = eng.cache.finish_external_linker_loads([req])
    return Loaded(req, n, slots, failed)


def forward(eng: Engine) -> None:
    """What every layer reads first: its KV buffer (or Mamba state) through the pools, which
    wait on the layer counter (SGLang's own `get_key_buffer` / `mamba2_layer_cache`)."""
    kv = eng.kvcache
    if isinstance(kv, SWAKVPool):
        layers = sorted(kv.layers_mapping)
    elif isinstance(kv, HybridLinearKVPool):
        layers = sorted(kv.full_attention_layer_id_mapping)
    else:
        layers = range(kv.start_layer, kv.end_layer)
    for layer in layers:
        kv.get_key_buffer(layer)
    for layer in sorted(getattr(eng.req_to_token_pool, "mamba_map", None) or ()):
        eng.req_to_token_pool.mamba2_layer_cache(layer)


# -- bytes ---------------------------------------------------------------------------------
def kv_buffers(eng: Engine) -> list:
    """Every per-layer full-attention buffer (K and V; MLA's latent KV)."""
    pool = getattr(eng.kvcache, "full_kv_pool", eng.kvcache)
    return (
        list(pool.kv_buffer)
        if isinstance(pool, MLATokenToKVPool)
        else [*pool.k_buffer, *pool.v_buffer]
    )


def swa_buffers(eng: Engine) -> list:
    pool = eng.kvcache.swa_kv_pool
    return [*pool.k_buffer, *pool.v_buffer]


def mamba_buffers(eng: Engine) -> list:
    cache = eng.req_to_token_pool.mamba_pool.mamba_cache
    return [
        state[layer] for state in (cache.temporal, *cache.conv) for layer in range(state.shape[0])
    ]


def scramble(eng: Engine, seed: int) -> None:
    """Seeded bytes in every device buffer of the engine (KV, SWA, Mamba state)."""
    gen = torch.Generator().manual_seed(seed)
    buffers = kv_buffers(eng) + (swa_buffers(eng) if eng.kind == "swa" else [])
    buffers += mamba_buffers(eng) if "mamba" in eng.kind else []
    for buf in buffers:
        raw = buf.view(torch.uint8).view(-1)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def digest(buffers, rows) -> str:
    """sha256 of the bytes at `rows` of every buffer (compared as bytes)."""
    h = hashlib.sha256()
    idx = torch.as_tensor(rows, dtype=torch.int64).flatten()
    for buf in buffers:
        h.update(buf.view(torch.uint8).view(buf.shape[0], -1)[idx].contiguous().numpy().tobytes())
    return h.hexdigest()


def mamba_slot(eng: Engine, tokens) -> int:
    """The Mamba state slot the tree keeps for the node that ends at `tokens`."""
    m = eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    assert m.device_prefix_len == len(tokens)
    value = eng.cache.tree_core.get_component_device_value(m.last_device_node, ComponentType.MAMBA)
    return int(value.flatten()[0])


def swa_slots(eng: Engine, full_slots) -> torch.Tensor:
    return eng.allocator.full_to_swa_index_mapping[full_slots]


def tokens_of(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * P))
