"""SGLang HiCache storage backend backed by kv-sidecar.

Load it in SGLang with:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
    '{"backend_name": "kv_sidecar", "module_path": "api.engine.sglang_backend",
      "class_name": "SidecarHiCacheStorage", "interface_v1": 1, "allocator": "shm",
      "sidecar_url": "unix:///run/kv-sidecar/sidecar.sock"}'

SGLang constructs it as `cls(storage_config, kwargs)`. Host pools that live in one shared
mapping (`"allocator": "shm"` keeps them in a memfd) are registered as shm buffers and
pages move by slot number (zero copy on the engine side); other pools (Mamba state across
several allocations) go through the inline page endpoints. No method raises: SGLang's
storage threads die on an exception, so every failure is a miss / `False` / 0, with a
rate-limited warning; after a sidecar restart the backend registers everything again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from typing import Any

from api.engine.client import ENGINE_URL, SidecarClient, SidecarError, SidecarUnavailable
from api.engine.sglang_pools import (
    PoolBinding,
    _tensor_bytes,
    bind_pool,
    namespace_name,
    namespace_spec,
)

try:  # the real interface when SGLang is importable (it always is inside SGLang)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult
except Exception:  # pragma: no cover - exercised only without SGLang
    from api.engine.sglang_compat import HiCacheStorage, PoolTransferResult

log = logging.getLogger("kv_sidecar.sglang")
_KV = "kv"
_DRAFT_SUFFIX = ".draft"


def never_raises(default):
    """Turn any exception into `default(self, *args)` (or `default`) and a rate-limited warning."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:  # the storage thread must never see an exception
                self._failed(fn.__name__, exc)
                return default(self, *args, **kwargs) if callable(default) else default

        return inner

    return wrap


def _falses(self, keys, *args, **kwargs):
    return [False] * len(keys)


def _pool_falses(self, transfers, *args, **kwargs):
    return {str(t.name): [False] * len(t.keys or []) for t in transfers or []}


def _empty_result(self, *args, **kwargs):
    return _result(0, {}, [])


def _result(hit: int, hits: dict, restorable: list):
    """A PoolTransferResult; SGLang releases before `restorable_prefix_pages` get two fields."""
    if "restorable_prefix_pages" in getattr(PoolTransferResult, "__dataclass_fields__", {}):
        return PoolTransferResult(hit, hits, restorable_prefix_pages=restorable)
    return PoolTransferResult(hit, hits)


class SidecarHiCacheStorage(HiCacheStorage):
    """HiCacheStorage over the sidecar's REST API (v1 zero copy, generic, v2 hybrid)."""

    def __init__(self, storage_config, kwargs: dict | None = None):
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        self.interface_v1 = bool(int(extra.get("interface_v1", 0) or 0))
        url = extra.get("sidecar_url") or os.environ.get("SIDECAR_URL", ENGINE_URL)
        token = extra.get("sidecar_token") or os.environ.get("SIDECAR_TOKEN")
        self.client = SidecarClient(
            url, token=token, timeout=float(extra.get("sidecar_timeout", 5.0))
        )
        self.bindings: dict[str, PoolBinding] = {}
        self.generic: dict[str, tuple[str, dict]] = {}  # "kind:bytes" -> (namespace, spec)
        self.registered_pools: dict[str, Any] = {}
        self.mem_pool_host = None
        self._stale = False
        self._last_warning = 0.0
        self.failures = 0

    # -- registration -----------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        self.mem_pool_host = mem_pool_host
        self._bind(_KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        name = str(getattr(host_pool_name, "value", host_pool_name))
        self.registered_pools[name] = host_pool
        if name != _KV or _KV not in self.bindings:
            self._bind(name, host_pool)

    @never_raises(None)
    def on_host_pools_registered(self) -> None:
        """SGLang's end of the attach burst (every pool of the group registered): one log line
        of how each pool moves. Pools registered later (draft sidecars) arrive through v2 alone."""
        how = {
            name: "marker"
            if b.logical
            else "zero copy"
            if b.buffer_id
            else "inline"
            if not b.namespace.startswith("unregistered-")
            else "unregistered"
            for name, b in self.bindings.items()
        }
        log.info("kv-sidecar pools: %s", ", ".join(f"{n} ({h})" for n, h in how.items()))

    def _bind(self, name: str, host_pool) -> None:
        try:
            self.bindings[name] = bind_pool(self.client, self.config, name, host_pool)
        except Exception as exc:
            self._failed(f"register {name}", exc)
            self._stale = True
            self.bindings[name] = PoolBinding.unbound(name, host_pool)

    def _ensure(self) -> None:
        """After a sidecar restart or a lost registration: register everything again."""
        if not self._stale:
            return
        for name, binding in list(self.bindings.items()):
            binding.close()
            self.bindings[name] = bind_pool(self.client, self.config, name, binding.host_pool)
        for ns, spec in self.generic.values():
            self.client.put_namespace(ns, **spec)
        self._stale = False

    def _call(self, fn, *args):
        """One client call; a lost registration re-registers and retries once."""
        self._ensure()
        try:
            return fn(*args)
        except SidecarUnavailable:
            self._stale = True
            raise
        except SidecarError as exc:
            if exc.code not in ("buffer_not_found", "namespace_not_found"):
                raise
            self._stale = True
            self._ensure()
            return fn(*args)

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        if isinstance(exc, SidecarUnavailable):
            self._stale = True
        now = time.monotonic()
        if now - self._last_warning > 30:
            self._last_warning = now
            log.warning("kv-sidecar %s failed (answering miss/false): %s", what, exc)

    # -- v1: KV pages by slot ---------------------------------------------------------
    @never_raises(0)
    def batch_exists(self, keys, extra_info=None) -> int:
        """Leading run of present pages, in the namespace of the interface SGLang drives:
        the zero-copy one with interface_v1, else the flat pages of the generic path."""
        if not keys:
            return 0
        binding = self.bindings[_KV]
        ns = (
            binding.namespace
            if self.interface_v1
            else self._generic_ns(keys[0], binding.page_bytes)
        )
        return self._call(self.client.exists, ns, list(keys))

    @never_raises(_falses)
    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._move("set", self.bindings[_KV], list(keys), host_indices)

    @never_raises(_falses)
    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._move("get", self.bindings[_KV], list(keys), host_indices)

    def _move(self, op: str, binding: PoolBinding, keys: list[str], host_indices) -> list[bool]:
        if not keys:
            return []
        P = binding.page_size
        if host_indices is None or host_indices.numel() != len(keys) * P:
            return [False] * len(keys)
        if binding.logical:  # DeepSeek-V4's logical anchor: marker pages, no bytes
            return self._call(binding.markers, self.client, op, keys)
        slots = (host_indices.view(-1)[::P] // P).tolist()
        if binding.buffer_id is None:
            return binding.inline(self.client, op, keys, slots)
        fn = self.client.set if op == "set" else self.client.get
        return self._call(fn, binding.namespace, keys, binding.buffer_id, slots)

    # -- generic path: flat page tensors (and the controller's `{hash}.draft` pages) ----
    def _generic_ns(self, key: str, nbytes: int) -> str:
        kind = "draft" if key.endswith(_DRAFT_SUFFIX) else _KV
        known = self.generic.get(f"{kind}:{nbytes}")
        if known is not None:
            return known[0]
        spec = namespace_spec(self.config, kind, nbytes, layout="flat")
        ns = namespace_name(self.config, kind, spec)
        self.client.put_namespace(ns, **spec)
        self.generic[f"{kind}:{nbytes}"] = (ns, spec)
        return ns

    @never_raises(None)
    def get(self, key, target_location=None, target_sizes=None):
        if target_location is None:
            return None
        if not target_location.is_contiguous():
            return None
        view = _tensor_bytes(target_location)
        page = self._call(self.client.get_page, self._generic_ns(key, len(view)), key)
        if page is None or len(page) != len(view):
            return None
        view[:] = page
        return target_location

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        targets = target_locations or [None] * len(keys)
        # SGLang's lists: never raise into its storage thread
        return [self.get(k, t) for k, t in zip(keys, targets, strict=False)]

    @never_raises(False)
    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        if value is None:
            return False
        value = value.contiguous()  # held while the view is in use
        view = _tensor_bytes(value)
        self._call(self.client.put_page, self._generic_ns(key, len(view)), key, view)
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        values = values or [None] * len(keys)
        # SGLang's lists: never raise into its storage thread
        return all(self.set(k, v) for k, v in zip(keys, values, strict=False))

    @never_raises(False)
    def exists(self, key) -> bool:
        kind = "draft" if key.endswith(_DRAFT_SUFFIX) else _KV
        names = [ns for k, (ns, _) in self.generic.items() if k.startswith(kind + ":")]
        if kind == _KV and _KV in self.bindings:
            names.append(self.bindings[_KV].namespace)
        return any(self._call(self.client.exists, ns, [key]) == 1 for ns in names)

    # -- v2: several pools (hybrid models) --------------------------------------------
    @never_raises(_empty_result)
    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        """The greatest endpoint every pool can restore, answered by the sidecar in one call,
        with every such endpoint for the controller's cross-rank intersection (block groups:
        reported only)."""
        keys = list(keys)
        extra, names, groups = [], {}, []
        for t in pool_transfers or []:
            name = str(t.name)
            if name == _KV:
                continue
            binding = self.bindings.get(name)
            ns = binding.namespace if binding else f"unregistered-{name}"
            policy = getattr(t.hit_policy, "value", t.hit_policy)
            if policy == "block_groups":
                groups.append((name, ns, max(1, int(getattr(t, "group_pages", 1) or 1))))
                continue
            names[ns] = name
            extra.append({"namespace": ns, "policy": policy, "window": max(1, len(t.keys or [1]))})
        res = self._call(self.client.batch_exists, keys, self.bindings[_KV].namespace, extra, True)
        hits = {_KV: res["kv"]} if res["kv"] else {}
        hits.update({names[ns]: n for ns, n in res["pools"].items() if n})
        for name, ns, group in groups:  # reported, never gating the KV hit
            present = (
                self._call(self.client.exists_each, ns, keys[: res["kv"]]) if res["kv"] else []
            )
            run = next((i for i, p in enumerate(present) if not p), len(present))
            if run // group:
                hits[name] = run // group * group
        return _result(res["hit"], hits, res["restorable"])

    @never_raises(_pool_falses)
    def batch_set_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        return {str(t.name): self._transfer("set", t) for t in transfers or []}

    @never_raises(_pool_falses)
    def batch_get_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        return {str(t.name): self._transfer("get", t) for t in transfers or []}

    def _transfer(self, op: str, t) -> list[bool]:
        keys = list(t.keys or [])
        binding = self.bindings.get(str(t.name))
        if binding is None or not keys:
            return [False] * len(keys)
        try:
            return self._move(op, binding, keys, t.host_indices)
        except Exception as exc:  # one pool failing leaves the others' answers intact
            self._failed(f"{op} {t.name}", exc)
            return [False] * len(keys)

    # -- housekeeping -----------------------------------------------------------------
    @never_raises(None)
    def clear(self) -> None:
        for ns in [b.namespace for b in self.bindings.values()] + [
            ns for ns, _ in self.generic.values()
        ]:
            try:
                self.client.delete_namespace(ns)
            except SidecarError as exc:
                if exc.code != "namespace_not_found":
                    raise
        self.generic.clear()
        self._stale = True

    @never_raises(None)
    def get_stats(self):
        return None

    @never_raises(None)
    def close(self) -> None:
        for binding in self.bindings.values():
            if binding.buffer_id is not None:
                with contextlib.suppress(SidecarError):
                    self.client.release_buffer(binding.namespace, binding.buffer_id)
            binding.close()
        self.client.close()
