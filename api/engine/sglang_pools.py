"""SGLang host pools as sidecar namespaces and buffers.

A host pool's pages are described by `get_page_buffer_meta(indices)`: per page, a list of
pointers and sizes (page_first: [K, V]; layer_first: [K l0, V l0, K l1, ...]; MLA: [KV];
Mamba: [temporal, conv 0, ...]). Pages 0 and 1 give each chunk's offset and stride:

    memfd mapping of the host pool (SGLang "allocator": "shm")
    +--------------------------------------------------------------------+
    ^start   ^K page 0   ^K page 1 (= + stride)     ^V page 0   ^V page 1
             chunk 0: offset = K0 - start, stride = K1 - K0, size = sizes[0]

When the chunks do not all lie in one memfd (no shm allocator, Mamba's separate
buffers), the pool is not shareable and its pages go through the inline endpoints: a page
is the bytes of `get_data_page(i, flat=True)`, and a load hands `set_from_flat_data_page`
those bytes viewed in the same dtype (it reshapes in the pool's dtype, so raw uint8 of a
bf16 pool would count twice the elements; Mamba's flat pages are uint8 already).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import orjson
import torch

from api.engine.client import SidecarError

log = logging.getLogger("kv_sidecar.sglang")
_SLUG = re.compile(r"[^0-9A-Za-z_.:-]+")


def namespace_spec(cfg, pool: str, page_bytes: int, layout: str, dtype: str = "",
                   page_tokens: int = 0) -> dict:
    """The namespace spec for one pool of one engine rank (deterministic everywhere)."""
    replicated = bool(cfg.is_mla_model) and pool != "mamba"  # Mamba is TP-sharded even in MLA
    extra = cfg.extra_config or {}
    model = cfg.model_name or ""
    if extra.get("sidecar_scope"):  # e.g. a LoRA or cache salt: keys carry neither
        model = f"{model}#{extra['sidecar_scope']}"
    if getattr(cfg, "dcp_size", 1) > 1:
        layout = f"{layout};dcp{cfg.dcp_rank}/{cfg.dcp_size}"
    rank = {"tp": 0 if replicated else cfg.tp_rank, "tp_size": cfg.tp_size,
            "pp": cfg.pp_rank, "pp_size": cfg.pp_size,
            "cp": cfg.attn_cp_rank, "cp_size": cfg.attn_cp_size}
    spec = {"page_bytes": page_bytes, "pool": pool, "model": model, "layout": layout,
            "dtype": dtype, "page_tokens": page_tokens, "rank": rank, "replicated": replicated}
    if extra.get("sidecar_share_gid") is not None:   # engines of other uids in this group share
        spec["share_gid"] = int(extra["sidecar_share_gid"])
    return spec


def namespace_name(cfg, pool: str, spec: dict) -> str:
    digest = hashlib.sha256(orjson.dumps(spec, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
    slug = _SLUG.sub("-", cfg.model_name or "model")[-48:].strip("-") or "model"
    return f"sgl.{slug}.{pool}.{digest}"


@dataclass(slots=True)
class PoolBinding:
    """One host pool registered with the sidecar: its namespace and, if shareable, buffer."""

    name: str
    namespace: str
    host_pool: Any
    page_size: int
    page_bytes: int
    buffer_id: Optional[str] = None
    chunks: list = field(default_factory=list)
    page_dtype: torch.dtype = torch.uint8  # the dtype of the pool's flat data page

    @classmethod
    def unbound(cls, name: str, host_pool) -> "PoolBinding":
        return cls(name, f"unregistered-{name}", host_pool, int(getattr(host_pool, "page_size", 1)), 0)

    def inline(self, client, op: str, keys: list[str], slots: list[int]) -> list[bool]:
        """Copy pages through the inline endpoints (pools that are not shareable)."""
        P, out = self.page_size, []
        for key, slot in zip(keys, slots):
            if op == "set":
                page = self.host_pool.get_data_page(slot * P, flat=True)
                out.append(client.put_page(self.namespace, key, _tensor_bytes(page)) or
                           client.exists(self.namespace, [key]) == 1)
            else:
                data = client.get_page(self.namespace, key)
                if data is None or len(data) != self.page_bytes:
                    out.append(False)
                    continue
                flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.page_dtype)
                self.host_pool.set_from_flat_data_page(slot * P, flat)
                out.append(True)
        return out


def bind_pool(client, cfg, name: str, host_pool) -> PoolBinding:
    """Create the pool's namespace and register its memory (zero copy when shareable)."""
    P = int(host_pool.page_size)
    chunks, page_bytes, where = _shared_layout(host_pool)
    page_dtype = host_pool.get_data_page(0, flat=True).dtype
    dtype = str(getattr(host_pool, "dtype", "")).replace("torch.", "")
    spec = namespace_spec(cfg, name, page_bytes, str(getattr(host_pool, "layout", "")), dtype, P)
    ns = namespace_name(cfg, name, spec)
    client.put_namespace(ns, **spec)
    binding = PoolBinding(name, ns, host_pool, P, page_bytes, chunks=chunks or [], page_dtype=page_dtype)
    if chunks:
        slots, size, fd = where
        try:
            binding.buffer_id = client.register_buffer(ns, size, slots, chunks, fd=fd)
        except SidecarError as exc:  # a TCP url (no fd passing): pages go inline
            if exc.code not in ("socket_required", "forbidden"):
                raise
            log.warning("pool %s moves pages inline: %s", name, exc.message)
            binding.chunks = []
    return binding


def _shared_layout(host_pool) -> tuple[Optional[list], int, Any]:
    """(chunks, page bytes, (slots, mapping size, fd)); chunks None when not shareable."""
    P = int(host_pool.page_size)
    try:
        ptrs, sizes = host_pool.get_page_buffer_meta(torch.arange(0, 2 * P, dtype=torch.int64))
    except Exception:
        ptrs = None
    if not ptrs:
        page = host_pool.get_data_page(0, flat=True)
        return None, page.numel() * page.element_size(), None
    n = len(ptrs) // 2
    page_bytes = int(sum(sizes[:n]))
    fd = getattr(host_pool, "fd", None)
    mapping = _mapping_of(fd, ptrs[0]) if fd is not None else None
    if mapping is None:
        return None, page_bytes, None
    start, size = mapping
    slots = int(host_pool.size) // P
    chunks = [{"offset": ptrs[i] - start, "stride": ptrs[n + i] - ptrs[i], "size": int(sizes[i])}
              for i in range(n)]
    fits = all(c["offset"] >= 0 and c["stride"] >= 0 and
               c["offset"] + (slots - 1) * c["stride"] + c["size"] <= size for c in chunks)
    return (chunks if fits else None), page_bytes, (slots, size, fd)


def _mapping_of(fd: int, address: int) -> Optional[tuple[int, int]]:
    """(start address, size) of this process's mapping of `fd` at file offset 0 that holds
    `address`; None when the fd is not mapped so (or is not shared memory)."""
    try:
        st = os.fstat(fd)
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if not (target.startswith("/memfd:") or target.startswith("/dev/shm/")):
        return None
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) < 6 or int(parts[4]) != st.st_ino or int(parts[2], 16) != 0:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return lo, min(hi - lo, st.st_size)
    return None


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    import ctypes
    t = t.contiguous()
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
