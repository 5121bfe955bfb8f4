"""SGLang host pools as sidecar namespaces and buffers.

A host pool's pages are described by `get_page_buffer_meta(indices)`: per page, a list of
pointers and sizes (page_first: [K, V]; layer_first: [K l0, V l0, K l1, ...]; MLA: [KV];
Mamba: [temporal, conv 0, ...]). Pages 0 and 1 give each chunk's offset and stride:

    memfd mapping of the host pool (SGLang "allocator": "shm")
    +--------------------------------------------------------------------+
    ^start   ^K page 0   ^K page 1 (= + stride)     ^V page 0   ^V page 1
             chunk 0: offset = K0 - start, stride = K1 - K0, size = sizes[0]

The memfd is the pool's `fd`, else its allocator's (SGLang's DSA indexer and DeepSeek-V4
host pools keep it only on `allocator`). When the chunks do not all lie in that memfd (no
shm allocator, Mamba's separate buffers, layer_first pools with one allocation a layer),
the pool is not shareable and its pages go through the inline endpoints: a page is the
bytes of `get_data_page(i, flat=True)`, and a load hands `set_from_flat_data_page` those
bytes viewed in the same dtype (it reshapes in the pool's dtype, so raw uint8 of a bf16
pool would count twice the elements; Mamba's flat pages are uint8 already).

A logical anchor (DeepSeek-V4's `LogicalHostPool`: page indices, no bytes) stores one
512-byte marker page per key, so "KV page present" still means "this page was written":

    marker buffer (memfd, 1 slot)      namespace sgl.<model>.kv.<digest>, layout "logical"
    +----------------------+           key h0 -> [512 zero bytes]   set: slot 0 for every key
    | slot 0: 512 x 0x00   |  ------>  key h1 -> [512 zero bytes]   get: presence only
    +----------------------+           ...

A page smaller than the sidecar's smallest (DeepSeek-V4's unified fp8 C128 rope pool at
SGLang's fixed 256-token page: 256 B) is stored padded, through the inline endpoints:

    sidecar page (512 B):  [ the pool's page bytes | zeros ]   a load takes the first part

Replication: MLA / DeepSeek-V4 pools are stored once for all TP ranks, except pools whose
host pool has heads (`head_num`: an MHA draft beside an MLA target, TP-sharded by head) and
Mamba state, which stay per rank.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from api.engine.client import SidecarError
from api.engine.shm import SharedBuffer, page_first_chunks

log = logging.getLogger("kv_sidecar.sglang")
_SLUG = re.compile(r"[^0-9A-Za-z_.:-]+")
MIN_PAGE = 512  # the sidecar's smallest page: a marker, or what a smaller page is padded to


def namespace_spec(
    cfg, pool: str, page_bytes: int, layout: str, dtype: str = "", page_tokens: int = 0
) -> dict:
    """The namespace spec for one pool of one engine rank (deterministic everywhere)."""
    replicated = bool(cfg.is_mla_model) and pool != "mamba"  # Mamba is TP-sharded even in MLA
    extra = cfg.extra_config or {}
    model = cfg.model_name or ""
    if extra.get("sidecar_scope"):  # e.g. a LoRA or cache salt: keys carry neither
        model = f"{model}#{extra['sidecar_scope']}"
    if getattr(cfg, "dcp_size", 1) > 1:
        layout = f"{layout};dcp{cfg.dcp_rank}/{cfg.dcp_size}"
    rank = {
        "tp": 0 if replicated else cfg.tp_rank,
        "tp_size": cfg.tp_size,
        "pp": cfg.pp_rank,
        "pp_size": cfg.pp_size,
        "cp": cfg.attn_cp_rank,
        "cp_size": cfg.attn_cp_size,
    }
    spec = {
        "page_bytes": page_bytes,
        "pool": pool,
        "model": model,
        "layout": layout,
        "dtype": dtype,
        "page_tokens": page_tokens,
        "rank": rank,
        "replicated": replicated,
        "key_format": "sglang",
    }  # KV events name a page by SGLang's int64 of its key
    if extra.get("sidecar_share_gid") is not None:  # engines of other uids in this group share
        spec["share_gid"] = int(extra["sidecar_share_gid"])
    return spec


def tp_sharded(host_pool) -> bool:
    """A host pool with attention heads (MHA, K-only) holds this rank's heads only: an MHA
    draft beside an MLA target is TP-sharded even though the target's KV is replicated."""
    return getattr(host_pool, "head_num", None) is not None


def per_rank(spec: dict, cfg) -> dict:
    """`spec` made rank-specific (a pool that is TP-sharded inside a replicated model)."""
    return {**spec, "replicated": False, "rank": {**spec["rank"], "tp": cfg.tp_rank}}


def namespace_name(cfg, pool: str, spec: dict) -> str:
    same = {k: v for k, v in spec.items() if k != "key_format"}  # what events call a page
    digest = hashlib.sha256(orjson.dumps(same, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
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
    buffer_id: str | None = None
    chunks: list = field(default_factory=list)
    page_dtype: torch.dtype = torch.uint8  # the dtype of the pool's flat data page
    stored_bytes: int = 0  # the namespace's page: page_bytes, or MIN_PAGE for a padded page
    marker: Any = None  # a logical anchor's marker page (SharedBuffer); None for real pools
    logical: bool = False

    @classmethod
    def unbound(cls, name: str, host_pool) -> PoolBinding:
        return cls(
            name, f"unregistered-{name}", host_pool, int(getattr(host_pool, "page_size", 1)), 0
        )

    def markers(self, client, op: str, keys: list[str]) -> list[bool]:
        """A logical anchor's pages: set stores the marker under each key, get answers
        presence (there are no bytes to load)."""
        if op == "get":
            return client.exists_each(self.namespace, keys)
        if self.buffer_id is not None:
            return client.set(self.namespace, keys, self.buffer_id, [0] * len(keys))
        blank = bytes(MIN_PAGE)
        return [
            client.put_page(self.namespace, k, blank) or client.exists(self.namespace, [k]) == 1
            for k in keys
        ]

    def close(self) -> None:
        if self.marker is not None:
            self.marker.close()
            self.marker = None

    def inline(self, client, op: str, keys: list[str], slots: list[int]) -> list[bool]:
        """Copy pages through the inline endpoints (pools that are not shareable)."""
        P, out, pad = self.page_size, [], bytes(max(0, self.stored_bytes - self.page_bytes))
        for key, slot in zip(keys, slots, strict=True):
            if op == "set":
                tensor = self.host_pool.get_data_page(
                    slot * P, flat=True
                ).contiguous()  # alive for the view
                page = _tensor_bytes(tensor)
                out.append(
                    client.put_page(self.namespace, key, bytes(page) + pad if pad else page)
                    or client.exists(self.namespace, [key]) == 1
                )
            else:
                data = client.get_page(self.namespace, key)
                if data is None or len(data) != max(self.stored_bytes, self.page_bytes):
                    out.append(False)
                    continue
                data = bytearray(data[: self.page_bytes])
                flat = torch.frombuffer(data, dtype=torch.uint8).view(self.page_dtype)
                self.host_pool.set_from_flat_data_page(slot * P, flat)
                out.append(True)
        return out


def bind_pool(client, cfg, name: str, host_pool) -> PoolBinding:
    """Create the pool's namespace and register its memory (zero copy when shareable)."""
    P = int(host_pool.page_size)
    chunks, page_bytes, where = _shared_layout(host_pool)
    if page_bytes == 0:  # a logical anchor: indices, no bytes
        return _bind_logical(client, cfg, name, host_pool)
    page_dtype = host_pool.get_data_page(0, flat=True).dtype
    dtype = str(getattr(host_pool, "dtype", "")).replace("torch.", "")
    layout, stored = str(getattr(host_pool, "layout", "")), max(page_bytes, MIN_PAGE)
    if stored != page_bytes:  # below the sidecar's smallest page: padded, inline
        chunks, layout = None, f"{layout};page{page_bytes}"
    spec = namespace_spec(cfg, name, stored, layout, dtype, P)
    if spec["replicated"] and tp_sharded(host_pool):
        spec = per_rank(spec, cfg)
    ns = namespace_name(cfg, name, spec)
    client.put_namespace(ns, **spec)
    binding = PoolBinding(
        name,
        ns,
        host_pool,
        P,
        page_bytes,
        chunks=chunks or [],
        page_dtype=page_dtype,
        stored_bytes=stored,
    )
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


def _bind_logical(client, cfg, name: str, host_pool) -> PoolBinding:
    """A namespace of marker pages for a pool without bytes, and the marker's memfd."""
    P = int(host_pool.page_size)
    spec = namespace_spec(cfg, name, MIN_PAGE, "logical", "", P)
    ns = namespace_name(cfg, name, spec)
    client.put_namespace(ns, **spec)
    binding = PoolBinding(name, ns, host_pool, P, MIN_PAGE, stored_bytes=MIN_PAGE, logical=True)
    binding.marker = SharedBuffer(MIN_PAGE, name="kv-sidecar-marker")
    try:
        binding.buffer_id = binding.marker.register(client, ns, 1, page_first_chunks(MIN_PAGE))
    except SidecarError as exc:  # a TCP url (no fd passing): markers go inline
        if exc.code not in ("socket_required", "forbidden"):
            binding.close()
            raise
    return binding


def _shared_layout(host_pool) -> tuple[list | None, int, Any]:
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
    if fd is None:  # DSA indexer and DeepSeek-V4 host pools keep it on their allocator
        fd = getattr(getattr(host_pool, "allocator", None), "fd", None)
    mapping = _mapping_of(fd, ptrs[0]) if fd is not None else None
    if mapping is None:
        return None, page_bytes, None
    start, size = mapping
    slots = int(host_pool.size) // P
    chunks = [
        {"offset": ptrs[i] - start, "stride": ptrs[n + i] - ptrs[i], "size": int(sizes[i])}
        for i in range(n)
    ]
    fits = all(
        c["offset"] >= 0
        and c["stride"] >= 0
        and c["offset"] + (slots - 1) * c["stride"] + c["size"] <= size
        for c in chunks
    )
    return (chunks if fits else None), page_bytes, (slots, size, fd)


def _mapping_of(fd: int, address: int) -> tuple[int, int] | None:
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
    """The bytes of contiguous `t`, no copy: valid while the caller holds `t`."""
    import ctypes

    if not t.is_contiguous():
        raise ValueError("a view of a non-contiguous tensor would outlive its copy")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
