"""An SGLang engine's device pools as sidecar pages, for the UnifiedCacheLinker.

SGLang describes each device pool as a `DevicePoolEntry` (its linker_pool_assembler): the
pool's buffers, grouped in components, each buffer a table of rows (a row is a token, or a
whole page where `rows_are_pages`). A sidecar page is one tree page of every buffer of the
pool, in the entry's own order, packed into one staging slot:

    device pool (MHA: rows = tokens, P per page)        staging slot (page_bytes, >= 512)
    K layer 0  rows pP .. pP+P-1  --------------------->  | K0 | K1 | ... | V0 | V1 | ... |
    K layer 1  rows pP .. pP+P-1  ---------------------------^    ^
    ...                                                           (offset = sum of the sizes
    V layer 0  rows pP .. pP+P-1  --------------------------------  of the buffers before it)

    Mamba (rows = state slots, one per page): | temporal l0 | temporal l1 | conv l0 | ...

The staging memfd (one per engine rank, lent to the sidecar once per pool) holds one region
per pool; the first half of a region is the offload thread's, the second the load thread's:

    +----------------- KV region ------------------+---- SWA region ----+-- MAMBA region --+
    | offload slots 0..C-1 | load slots C..2C-1    | offload  |  load   | offload |  load  |
    +----------------------------------------------+--------------------+------------------+
      chunk of the KV namespace's buffer: offset = region start, stride = size = slot bytes

Pools: SGLang 0.5.23's own `resolve_hybrid_device_pool_group` builds the groups it supports
(MLA + Mamba, Mamba + SWA); it refuses plain KV, KV + SWA and MHA + Mamba, which are built
here from its own entry helpers (`_mha_device_pool_entry`, `_mamba_device_pool_entry`). Only
KV, SWA and MAMBA pools are served: DSA indexer, DeepSeek-V4 and draft pools keep the HiCache
backend (docs/sglang.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache import linker_pool_assembler as lpa
from sglang.srt.runtime_context import get_parallel

from api.engine.restore_cost import RestoreCost
from api.engine.sglang_linker_cuda import page_views

SUPPORTED = (PoolName.KV, PoolName.SWA, PoolName.MAMBA)
MIN_PAGE = 512  # the sidecar's smallest page: a smaller pool page is padded in its slot


def device_pool_group(
    kvcache, params, page_size: int, components
) -> tuple[lpa.DevicePoolGroup, str]:
    """SGLang's linker view of the engine's device pools and who built it ("sglang": its
    assembler; "kv-sidecar": here, from its entry helpers, for the groups it refuses); a pool
    other than KV, SWA and MAMBA is refused, and so are draft pools."""
    drafts = [
        getattr(params, f, ())
        for f in ("mtp_draft_device_pools", "sidecar_draft_device_pools", "mtp_draft_mamba_pools")
    ]
    if any(drafts):
        raise ValueError(
            "the kv-sidecar linker does not store speculative draft KV: use the HiCache "
            "backend (api.sglang_backend, docs/sglang.md) for models with draft pools"
        )
    try:
        group, source = (
            lpa.resolve_hybrid_device_pool_group(
                kvcache=kvcache, page_size=page_size, params=params, components=set(components)
            ),
            "sglang",
        )
    except (ValueError, AssertionError) as refused:
        group, source = _own_group(kvcache, params, page_size, refused), "kv-sidecar"
    unsupported = [str(n.value) for n in group.entry_map if n not in SUPPORTED]
    if unsupported:
        raise ValueError(
            f"the kv-sidecar linker serves KV, SWA and Mamba pools; this model also "
            f"has {unsupported}: use the HiCache backend (api.sglang_backend, "
            f"docs/sglang.md) for DSA indexer, DeepSeek-V4 and draft pools"
        )
    return group, source


def _own_group(kvcache, params, page_size: int, refused: Exception) -> lpa.DevicePoolGroup:
    """The groups SGLang's assembler refuses: plain MHA / MLA, SWA + full, MHA + Mamba."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        _stage_local_layer_mapping,
        _swa_layer_mappings,
    )
    from sglang.srt.mem_cache.memory_pool import (
        HybridLinearKVPool,
        MHATokenToKVPool,
        MLATokenToKVPool,
    )
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    if isinstance(kvcache, SWAKVPool):
        full, swa = _swa_layer_mappings(kvcache)
        entries = [
            lpa._mha_device_pool_entry(PoolName.KV, kvcache.full_kv_pool, full, page_size),
            lpa._mha_device_pool_entry(PoolName.SWA, kvcache.swa_kv_pool, swa, page_size),
        ]
    elif isinstance(kvcache, HybridLinearKVPool) and isinstance(
        kvcache.full_kv_pool, MHATokenToKVPool
    ):
        mapping = _stage_local_layer_mapping(
            kvcache.full_attention_layer_id_mapping, kvcache.start_layer
        )
        entries = [
            lpa._mha_device_pool_entry(PoolName.KV, kvcache.full_kv_pool, mapping, page_size),
            lpa._mamba_device_pool_entry(params.req_to_token_pool, kvcache.start_layer),
        ]
    elif isinstance(kvcache, MHATokenToKVPool):
        layers = {i: i for i in range(len(kvcache.k_buffer))}
        entries = [lpa._mha_device_pool_entry(PoolName.KV, kvcache, layers, page_size)]
    elif type(kvcache) is MLATokenToKVPool:
        entries = [
            lpa.DevicePoolEntry(
                name=PoolName.KV,
                indices_from_pool=PoolName.KV,
                device_pool=kvcache,
                components=[kvcache.kv_buffer],
                page_size=page_size,
                layer_mapping={i: i for i in range(len(kvcache.kv_buffer))},
                rows_are_pages=False,
            )
        ]
        return lpa.DevicePoolGroup(entries, len(kvcache.kv_buffer), page_size, rank_replicated=True)
    else:
        raise refused
    layers = max(layer for e in entries for layer in e.layer_mapping) + 1
    return lpa.DevicePoolGroup(entries, layers, page_size)


def is_mla(entry) -> bool:
    """An MLA KV pool (latent KV, the same on every TP rank)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return isinstance(entry.device_pool, MLATokenToKVPool)


@dataclass
class PoolLayout:
    """One device pool's page as a staging slot, and the copies between them. Each buffer is
    viewed as (pages, its bytes of a page): a tree page's rows are contiguous in a buffer.
    On CPU the copies are numpy row gathers / scatters (memcpy a row; torch's CPU
    `index_copy_` runs element by element, 0.1-0.5 GB/s here); other devices use torch."""

    name: PoolName
    entry: Any
    pages: list = field(default_factory=list)  # each buffer as uint8 (pages, its bytes a page)
    offsets: list = field(default_factory=list)  # each buffer's offset in the page
    span: int = 1  # buffer rows per page
    page_bytes: int = 0  # the pool's bytes per page
    slot_bytes: int = 0  # page_bytes, padded to MIN_PAGE
    region: int = 0  # the pool's region in the staging memfd
    slots: int = 0  # C: slots per direction

    @classmethod
    def of(cls, name: PoolName, entry) -> PoolLayout:
        first = entry.kv_buffer[0]
        row_bytes = first.view(torch.uint8).view(first.shape[0], -1).shape[1]
        span = entry.buffer_meta[0][0][2] // row_bytes  # page bytes / row bytes
        pages = page_views(entry.kv_buffer, span)
        offsets, at = [], 0
        for p in pages:
            offsets.append(at)
            at += p.shape[1]
        return cls(name, entry, pages, offsets, span, at, max(at, MIN_PAGE))

    def describe(self) -> str:
        """What makes two engines' pages of this pool interchangeable (shapes, dtypes, order)."""
        shape = [(str(b.dtype), list(b.shape[1:])) for b in self.entry.kv_buffer]
        blob = orjson.dumps({"span": self.span, "buffers": shape, "page": self.page_bytes})
        return f"linker;{hashlib.sha256(blob).hexdigest()[:16]}"

    def dtype(self) -> str:
        names = sorted({str(b.dtype).replace("torch.", "") for b in self.entry.kv_buffer})
        return "+".join(names)

    @property
    def on_cpu(self) -> bool:
        return self.pages[0].device.type == "cpu"

    def _index(self, rows: Sequence[int]):
        """Page numbers of SGLang's locations (a page's first row)."""
        index = torch.tensor([r // self.span for r in rows], dtype=torch.int64)
        return index.numpy() if self.on_cpu else index.to(self.pages[0].device)

    def to_staging(self, stage: torch.Tensor, rows: Sequence[int], first_slot: int) -> None:
        """Copy the pages at device `rows` into slots first_slot.. of this pool's region."""
        n = len(rows)
        if not n:
            return
        index, table = self._index(rows), self.table(stage)
        for pages, off in zip(self.pages, self.offsets, strict=True):
            size = pages.shape[1]
            if self.on_cpu:
                table.numpy()[first_slot : first_slot + n, off : off + size] = pages.numpy()[index]
            else:
                table[first_slot : first_slot + n, off : off + size].copy_(
                    pages.index_select(0, index)
                )

    def from_staging(self, stage: torch.Tensor, rows: Sequence[int], first_slot: int) -> None:
        """Copy slots first_slot.. of this pool's region into the pages at device `rows`."""
        n = len(rows)
        if not n:
            return
        index, table = self._index(rows), self.table(stage)
        for pages, off in zip(self.pages, self.offsets, strict=True):
            src = table[first_slot : first_slot + n, off : off + pages.shape[1]]
            if self.on_cpu:
                pages.numpy()[index] = src.numpy()
            else:
                pages.index_copy_(0, index, src.to(pages.device))

    def table(self, stage: torch.Tensor) -> torch.Tensor:
        """This pool's region of the staging bytes as (2C, slot bytes)."""
        size = 2 * self.slots * self.slot_bytes
        return stage[self.region : self.region + size].view(2 * self.slots, self.slot_bytes)

    def chunks(self) -> list[dict]:
        return [{"offset": self.region, "stride": self.slot_bytes, "size": self.slot_bytes}]


def plan_staging(layouts: Sequence[PoolLayout], pages: int, budget: int) -> int:
    """Give every pool C slots a direction (at most `pages`, and the C whose slots of all pools
    fit in `budget` bytes a direction; at least 1) and its region; the staging bytes."""
    per_page = sum(lay.slot_bytes for lay in layouts)
    slots = max(1, min(pages, budget // max(1, per_page)))
    at = 0
    for lay in layouts:
        lay.slots = max(1, min(slots, min(p.shape[0] for p in lay.pages)))
        lay.region = at
        at += 2 * lay.slots * lay.slot_bytes
    return at


def page_rows(layout: PoolLayout, transfer) -> list[int] | None:
    """The device rows of a transfer's pages (SGLang's `prepare_locations` of its indices),
    None when they do not match its keys one to one."""
    indices = transfer.host_indices
    if indices is None or not transfer.keys:
        return None
    rows = layout.entry.prepare_locations(indices)
    return rows if len(rows) == len(transfer.keys) else None


def restore_cost_of(extra: dict) -> RestoreCost | None:
    """The linker's restore cost (`restore_cost`, on by default). SGLang's forward times do
    not reach the linker: the prefill rate is `prefill_tokens_per_s` when given, and until
    then every restore is worth it (loads are still timed)."""
    if str(extra.get("restore_cost", True)).lower() in ("0", "false", "no", "off"):
        return None
    cost = RestoreCost(probe_s=float(extra.get("restore_probe_s", 60.0)))
    if extra.get("prefill_tokens_per_s"):
        cost.prefill.add(float(extra["prefill_tokens_per_s"]))
    return cost


def merge_items(requests) -> list:
    """One (pool, keys, rows) per pool for a whole batch of requests, in request order."""
    merged: dict = {}
    for items in requests:
        for name, keys, rows in items:
            k, r = merged.setdefault(name, ([], []))
            k.extend(keys)
            r.extend(rows)
    return [(name, k, r) for name, (k, r) in merged.items()]


def tp_rank_of(params) -> tuple[int, int]:
    """The attention-TP rank and size (the group the tree reduces hits over)."""
    group = params.attn_tp_cache_group or params.tp_cache_group
    if (
        group is not None
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    ):
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(
            group=group
        )
    parallel = get_parallel()
    return int(getattr(parallel, "tp_rank", 0) or 0), int(getattr(parallel, "tp_size", 1) or 1)
