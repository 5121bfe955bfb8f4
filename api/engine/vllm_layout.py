"""vLLM KV cache blocks as sidecar pages: which bytes make a page, and the namespace they share.

A page is one KV cache block of every attention layer of this rank, in layer order. Each
layer tensor is seen as one or more block-major views (dim 0 = block, one block contiguous):
CPU_ATTN's `[blocks, kv_heads, block_size, 2*head]` gives one view, FlashAttention's
`[2, blocks, block_size, kv_heads, head]` two (K, V). The in-block layout is the backend's
own (it depends on the CPU kernel path: amx, vec, neon...), so pages are opaque bytes and the
namespace names the backend and kernel path.

    staging memfd, slot s = one page (page_first)
    +---------- slot 0 ----------+---------- slot 1 ----------+--- ...
    | L0 view0 | L0 view1 | L1 ..| L0 view0 | L0 view1 | L1 ..|
      ^ view j of block b is copied to [s * page_bytes + offset_j, + size_j)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
import torch

_SLUG = re.compile(r"[^0-9A-Za-z_.:-]+")


@dataclass(frozen=True)
class PageLayout:
    """Block-major byte views of the KV cache and where each lands inside a page."""

    views: tuple[torch.Tensor, ...]  # uint8 [num_blocks, size_j], rows contiguous
    offsets: tuple[int, ...]
    page_bytes: int
    num_blocks: int
    describe: str  # shapes and dtypes, for the namespace

    @classmethod
    def of(cls, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> PageLayout:
        """Views of every layer (in the dict's order, which is the model's layer order); a
        layer given as a list of tensors (state caches) contributes each of them."""
        views, offsets, parts, offset = [], [], [], 0
        for _name, layer in kv_caches.items():
            for t in layer if isinstance(layer, (list, tuple)) else [layer]:
                for v in _block_major(t, num_blocks):
                    u8 = v.flatten(1).view(torch.uint8)
                    views.append(u8)
                    offsets.append(offset)
                    offset += u8.shape[1]
                parts.append(f"{tuple(t.shape)}:{tuple(t.stride())}:{t.dtype}")
        if not views:
            raise ValueError("no KV cache tensors")
        return cls(tuple(views), tuple(offsets), offset, num_blocks, ";".join(parts))

    def staging_views(self, staging: torch.Tensor) -> list[torch.Tensor]:
        """The matching [slots, size_j] windows of a uint8 [slots, page_bytes] staging tensor."""
        return [
            staging[:, o : o + v.shape[1]] for v, o in zip(self.views, self.offsets, strict=True)
        ]

    def to_staging(
        self, staging: Sequence[torch.Tensor], blocks: list[int], slots: list[int]
    ) -> None:
        """Copy KV blocks `blocks` into staging slots `slots` (all layers)."""
        for b, s, n in _runs(blocks, slots):
            for view, window in zip(self.views, staging, strict=True):
                window[s : s + n].copy_(view[b : b + n])

    def from_staging(
        self, staging: Sequence[torch.Tensor], slots: list[int], blocks: list[int]
    ) -> None:
        """Copy staging slots `slots` into KV blocks `blocks` (all layers)."""
        for b, s, n in _runs(blocks, slots):
            for view, window in zip(self.views, staging, strict=True):
                view[b : b + n].copy_(window[s : s + n])


def _runs(a: Sequence[int], b: Sequence[int]):
    """(a0, b0, n) for each maximal run where both a and b count up by one: one row copy each
    (a strided copy of whole rows runs at memcpy speed; an index_copy_ of bytes does not)."""
    i = 0
    while i < len(a):
        n = 1
        while i + n < len(a) and a[i + n] == a[i] + n and b[i + n] == b[i] + n:
            n += 1
        yield a[i], b[i], n
        i += n


def _block_major(t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    if t.dim() >= 2 and t.shape[0] == num_blocks and t[0].is_contiguous():
        return [t]
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks and t[0, 0].is_contiguous():
        return [t[0], t[1]]
    raise ValueError(
        f"unsupported KV cache layout {tuple(t.shape)} strides {t.stride()} "
        f"for {num_blocks} blocks (need the block dimension first, or after K/V)"
    )


@dataclass(frozen=True)
class EngineScope:
    """What besides the page layout makes pages interchangeable: `backend` names the
    attention backend and kernel path, `hashing` the block hash algorithm and its block size
    (keys are vLLM's chained block hashes), `rank` the TP/PP/CP rank and sizes."""

    model: str
    dtype: str
    block_size: int
    backend: str
    hashing: str
    rank: dict


def namespace_spec(
    scope: EngineScope,
    layout: PageLayout,
    share_gid: int | None = None,
    pool: str = "kv",
    group: str = "",
) -> dict:
    """The sidecar namespace spec: equal exactly when pages are interchangeable. KV events
    name its pages by vLLM's block hash (`key_format`); `share_gid` lets engines of other
    uids in that group share it (docs/security.md, "Tenants"). A hybrid model's KV cache
    group adds its pool kind and `group`, a description of its vLLM spec (in the digest)."""
    digest = hashlib.sha256(
        (layout.describe + (f"|{group}" if group else "")).encode()
    ).hexdigest()[:16]
    spec = {
        "page_bytes": layout.page_bytes,
        "pool": pool,
        "model": scope.model,
        "dtype": scope.dtype,
        "page_tokens": scope.block_size,
        "rank": scope.rank,
        "layout": f"vllm:{scope.backend}:{scope.hashing}:{digest}",
        "key_format": "vllm",
    }
    if share_gid is not None:
        spec["share_gid"] = int(share_gid)
    return spec


def namespace_name(spec: dict) -> str:
    """`vllm.<model slug>.<digest of the spec>`: deterministic on every process and node
    (what events call a page, `key_format`, is not part of what the page is)."""
    same = {k: v for k, v in spec.items() if k != "key_format"}
    digest = hashlib.sha256(orjson.dumps(same, option=orjson.OPT_SORT_KEYS)).hexdigest()[:20]
    slug = _SLUG.sub("-", spec["model"])[-48:].strip("-.") or "model"
    return f"vllm.{slug}.{digest}"


def block_keys(block_hashes: Sequence[bytes], ratio: int, limit: int) -> list[str]:
    """Keys of the first full KV blocks: the hash ending each block, hex (64 chars for
    sha256). `ratio` = KV block size / hash block size; at most `limit` keys."""
    n = min(len(block_hashes) // ratio, limit)
    return [_hex(block_hashes[(i + 1) * ratio - 1]) for i in range(max(n, 0))]


def _hex(h) -> str:
    if not isinstance(h, (bytes, bytearray)):
        raise TypeError(f"block hash of type {type(h).__name__}, expected bytes")
    return h.hex()
