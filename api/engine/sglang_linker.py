"""SGLang's UnifiedCacheLinker on kv-sidecar: the node's one shared host pool as the L2
behind every engine's device pools (no private HiCache host pool per instance).

Load it in SGLang (no `--enable-hierarchical-cache`) with:

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "SidecarLinker",
        "linker_module_path": "api.sglang_linker",
        "linker_extra_config": {"sidecar_url": "unix:///run/kv-sidecar/sidecar.sock"}}'

SGLang constructs it per worker (`linker_factory.create_unified_cache_linker`) as
`SidecarLinker(server_args, params, components=..., extra_config=..., forward_stream=...)`.
The tree (`UnifiedCacheLinkerWrapper`) drives it from the scheduler thread:

    match_prefix   -> lookup(rid, [KV, SWA?, MAMBA?])   one POST /v1/batch/exists, restorable
    init_load_back -> load(rid, transfers)               queued, no I/O
    batch start    -> start_layer_wise_loading()         hands the batch to the load thread
    forward        -> layer_done_counter.wait_until(l)   (the KV pools call it per layer)
    after forward  -> finish_layer_wise_loading(i)       False: the batch's loads are aborted
    insert/BackupKV-> offload(transfers)                 queued for the offload thread
    every step     -> num_completed_offloads / pop_completed_offload

    load thread:    batch/get (keys -> staging load slots) -> copy slots into device pages
    offload thread: copy device pages into staging offload slots -> batch/set (keys, slots);
                    the nodes queued behind a set in flight go together in the next one

On a GPU each device pool is registered with the sidecar once, by CUDA IPC, and the sidecar
copies its pages on its own streams, after the offload thread has seen the linker's events
complete (`api.engine.sglang_linker_cuda`; `"device_ipc": false` in the extra config, a
sidecar without CUDA, or a page under 512 bytes keep the staging path). Elsewhere pages move
through a staging memfd lent to the sidecar over the engine socket (SCM_RIGHTS), as the vLLM
worker's saves do; the layout is in `api.engine.sglang_linker_pools`. Nothing raises into
SGLang: a failed lookup is no hit, a failed load fails its batch's layer counter (SGLang
then aborts those requests), a failed offload is `False`; after a sidecar restart the
namespaces and buffers are registered again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import threading
import time

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)
from sglang.srt.runtime_context import get_parallel

from api.engine.client import ENGINE_URL, SidecarClient, SidecarError, SidecarUnavailable
from api.engine.restore_cost import HOST
from api.engine.sglang_linker_cuda import DevicePool, direct_pool, gate
from api.engine.sglang_linker_pools import (
    PoolLayout,
    device_pool_group,
    is_mla,
    merge_items,
    page_rows,
    plan_staging,
    restore_cost_of,
    tp_rank_of,
)
from api.engine.sglang_pools import namespace_name, namespace_spec
from api.engine.shm import SharedBuffer

log = logging.getLogger("kv_sidecar.sglang_linker")
_LOST = ("buffer_not_found", "namespace_not_found")
_REGISTER = object()  # an offload-queue item: register again (asked for by a lookup)


def _quiet(default):
    """Any exception becomes `default` and a rate-limited warning: SGLang's scheduler must
    never see one from the linker."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                self._failed(fn.__name__, exc)
                return default() if callable(default) else default

        return inner

    return wrap


class SidecarLinker(UnifiedCacheLinker):
    """Device pools <-> the sidecar's host pool, through a staging memfd."""

    def __init__(self, server_args, params, *, components, extra_config=None, forward_stream=None):
        extra = dict(extra_config or {})
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.pool_group, self.pool_source = device_pool_group(
            kvcache, params, self.page_size, components
        )
        self.pools = self.pool_group.entry_map
        self.tp_rank, self.tp_size = tp_rank_of(params)
        self.layouts = {n: PoolLayout.of(n, e) for n, e in self.pools.items()}
        size = plan_staging(
            list(self.layouts.values()),
            int(extra.get("staging_pages", 64)),
            int(extra.get("staging_mib", 256)) << 20,
        )
        self.staging = SharedBuffer(size, name="kv-sidecar-linker")
        self.stage: torch.Tensor | None = self.staging.bytes  # None once closed
        self.cfg = self._storage_config(server_args, params, extra)
        self.specs = {n: self._spec(lay) for n, lay in self.layouts.items()}
        self.names = {n: namespace_name(self.cfg, n.value, s) for n, s in self.specs.items()}
        self.direct: dict[PoolName, DevicePool] = {}  # pools the sidecar copies by CUDA IPC
        if extra.get("device_ipc", True):
            for n, lay in self.layouts.items():
                pool = direct_pool(self.names[n], lay.pages, lay.span, lay.entry.kv_buffer)
                if pool is not None:
                    self.direct[n] = pool
        url = extra.get("sidecar_url") or os.environ.get("SIDECAR_URL", ENGINE_URL)
        token = extra.get("sidecar_token") or os.environ.get("SIDECAR_TOKEN")
        self.client = SidecarClient(
            url, token=token, timeout=float(extra.get("sidecar_timeout", 5.0))
        )
        self.lookups = SidecarClient(
            url, token=token, timeout=float(extra.get("lookup_timeout", 1.0))
        )
        self.buffers: dict[PoolName, str] = {}
        self._stale = False
        self.reg_lock = threading.Lock()
        self.layer_done_counter = LayerWiseLoadCounter(self.pool_group.num_layers)
        if PoolName.MAMBA in self.pools:  # the Mamba layers wait on the same counter
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        self.pending: dict[str, list] = {}
        self.load_queue: queue.Queue = queue.Queue()
        self.offload_queue: queue.Queue = queue.Queue()
        self.offload_results: queue.Queue = queue.Queue()
        self.stats = {
            "lookups": 0,
            "hits": 0,
            "pages_loaded": 0,
            "pages_offloaded": 0,
            "load_failures": 0,
            "offload_failures": 0,
            "failures": 0,
        }
        self._down_until = 0.0
        self._last_warning = 0.0
        self.cost = restore_cost_of(extra)
        self._register_quietly()
        self.threads = [
            threading.Thread(target=fn, daemon=True, name=f"kv-sidecar-{what}-tp{self.tp_rank}")
            for what, fn in (("load", self._load_loop), ("offload", self._offload_loop))
        ]
        for t in self.threads:
            t.start()

    # -- identity -------------------------------------------------------------------------
    def _storage_config(self, server_args, params, extra: dict) -> HiCacheStorageConfig:
        kv = self.pools[PoolName.KV]
        model = getattr(server_args, "served_model_name", None) or getattr(
            server_args, "model_path", ""
        )
        return HiCacheStorageConfig(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=params.pp_rank,
            pp_size=params.pp_size,
            attn_cp_rank=params.attn_cp_rank,
            attn_cp_size=params.attn_cp_size,
            is_mla_model=is_mla(kv) or self.pool_group.rank_replicated,
            enable_storage_metrics=False,
            is_page_first_layout=False,
            model_name=model,
            extra_config=extra,
        )

    def _spec(self, layout: PoolLayout) -> dict:
        """The namespace of one device pool of this rank: device layout, never a host layout,
        so a HiCache engine's pages never mix with a linker engine's."""
        shape = layout.describe()
        dcp = get_parallel().attn_dcp_size
        if dcp > 1:
            shape += f";dcp{get_parallel().attn_dcp_rank}/{dcp}"
        return namespace_spec(
            self.cfg,
            layout.name.value,
            layout.slot_bytes,
            shape,
            layout.dtype(),
            layout.entry.page_size,
        )

    def writes(self, name: PoolName) -> bool:
        """A replicated pool (MLA) is written by TP rank 0 only; every rank reads it."""
        return not self.specs[name]["replicated"] or self.tp_rank == 0

    # -- registration (again after a sidecar restart) ---------------------------------------
    def _register(self) -> None:
        """Namespaces and staging buffers of every pool; after a lost registration the old
        buffers are released first (a sidecar that merely timed out still holds them)."""
        with self.reg_lock:
            if self._stale:
                old, self.buffers = self.buffers, {}
                for name, buffer_id in old.items():
                    with contextlib.suppress(SidecarError):  # gone with a restarted sidecar
                        self.client.release_buffer(self.names[name], buffer_id)
                for pool in self.direct.values():
                    pool.release(self.client)
                self._stale = False
            for name, layout in self.layouts.items():
                if name in self.buffers or (name in self.direct and self.direct[name].buffer_id):
                    continue
                ns = self.names[name]
                self.client.put_namespace(ns, **self.specs[name])
                if name in self.direct and self._register_device(name):
                    continue
                self.buffers[name] = self.client.register_buffer(
                    ns, self.staging.size, 2 * layout.slots, layout.chunks(), fd=self.staging.fd
                )

    def _register_device(self, name: PoolName) -> bool:
        """Register a device pool by CUDA IPC (once); False, and the staging path for good,
        when the sidecar or this process cannot (no CUDA there, a VMM allocation here)."""
        try:
            self.direct[name].register(self.client)
            return True
        except SidecarUnavailable:
            raise
        except (SidecarError, ValueError, RuntimeError) as exc:
            log.warning(
                "kv-sidecar linker: %s by CUDA IPC refused (%s); staging instead",
                self.names[name],
                exc,
            )
            del self.direct[name]
            return False

    def _register_quietly(self) -> None:
        try:
            self._register()
        except Exception as exc:
            self._failed("register", exc)

    def _lost(self) -> None:
        self._stale = True  # no lock: the scheduler thread may call this

    def _call(self, fn, items: list, load: bool):
        """One batch call by slot (`fn(body)`, the body built from the current buffer ids); a
        lost registration (restart) registers again and retries once."""
        for attempt in (0, 1):
            self._register()
            try:
                return fn([self._item(name, keys, rows, load) for name, keys, rows in items])
            except SidecarUnavailable:
                self._lost()
                if attempt:
                    raise
            except SidecarError as exc:
                if exc.code not in _LOST or attempt:
                    raise
                self._lost()
        raise AssertionError("unreachable")

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats["failures"] += 1
        if isinstance(exc, SidecarUnavailable):
            self._down_until = time.monotonic() + 1.0  # the scheduler stops asking for a second
            self._lost()
        now = time.monotonic()
        if now - self._last_warning > 30:
            self._last_warning = now
            log.warning("kv-sidecar linker %s failed (a miss / not stored): %s", what, exc)

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    # -- lookup: the scheduler thread, one round trip ---------------------------------------
    @_quiet(list)
    def lookup(self, rid: str, transfers) -> list[int]:
        """Every prefix length (pages) restorable on this rank: the sidecar's hybrid rule."""
        if self._down():
            return []
        expanded = self.pool_group.resolve_transfers(transfers)
        kv = next((t for t in expanded if t.name == PoolName.KV), None)
        if kv is None or not kv.keys:
            return []
        extra = [
            {
                "namespace": self.names[t.name],
                "policy": t.hit_policy.value,
                "window": max(1, len(t.keys)),
            }
            for t in expanded
            if t.name != PoolName.KV
        ]
        self.stats["lookups"] += 1
        try:
            res = self.lookups.batch_exists(
                list(kv.keys), self.names[PoolName.KV], extra, restorable=True
            )
        except SidecarError as exc:
            if exc.code in _LOST:  # a restarted sidecar: the offload thread registers again
                self._lost()
                self.offload_queue.put(_REGISTER)
                return []
            raise
        restorable = [int(p) for p in res.get("restorable") or []]
        if restorable and self.cost is not None:
            restorable = self._worth(restorable)
        self.stats["hits"] += bool(restorable)
        return restorable

    def _worth(self, restorable: list[int]) -> list[int]:
        """The prefix lengths whose restore beats their prefill (api/engine/restore_cost.py);
        a longest prefix not worth it is counted skipped by the sidecar."""
        cost = self.cost
        if cost is None:  # no restore cost: every prefix is worth restoring
            return restorable
        page = sum(lay.page_bytes for lay in self.layouts.values())
        keep = [p for p in restorable if cost.worth(p * self.page_size, {HOST: p * page})]
        if len(keep) < len(restorable):
            self.stats["skipped"] = self.stats.get("skipped", 0) + 1
            try:
                self.lookups.skipped(
                    self.names[PoolName.KV], 1, max(restorable) - max(keep, default=0)
                )
            except Exception as exc:
                log.debug("kv-sidecar linker: reporting a skipped restore failed: %s", exc)
        return keep

    # -- loads ------------------------------------------------------------------------------
    @_quiet(False)
    def load(self, rid: str, transfers) -> bool:
        """Queue a load into the request's device slots (run by the next batch start)."""
        if self._down() or rid in self.pending:
            return False
        expanded = self.pool_group.resolve_transfers(
            transfers, allow_partial=True, allow_missing_kv=True
        )
        items = [(t.name, list(t.keys), page_rows(self.layouts[t.name], t)) for t in expanded]
        if not items or any(rows is None for _, _, rows in items):
            return False
        self.pending[rid] = items
        return True

    @_quiet(-1)
    def start_layer_wise_loading(self) -> int:
        if not self.pending:
            return -1
        batch, self.pending = self.pending, {}
        index = self.layer_done_counter.update_producer()
        self.load_queue.put((index, batch))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        try:
            return self.layer_done_counter.finish(counter_index)
        except Exception as exc:
            self._failed("finish loading", exc)
            return False

    @_quiet(False)
    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending.pop(rid, None) is not None

    def _load_loop(self) -> None:
        while True:
            task = self.load_queue.get()
            try:
                if task is None:
                    return
                index, batch = task
                self._load_batch(index, batch)
            finally:
                self.load_queue.task_done()

    def _load_batch(self, index: int, batch: dict) -> None:
        """Every page of the batch into its device slots, then every layer is done; any page
        missing (evicted, corrupt, sidecar down) fails the whole counter index."""
        items = merge_items(batch.values())
        started = time.monotonic()
        try:
            for round_items in self._rounds(items):
                loaded = self._call(self.client.batch_get, round_items, True)
                missing = sum(
                    not ok for name, _, _ in round_items for ok in loaded[self.names[name]]
                )
                if missing:
                    raise LookupError(f"{missing} page(s) no longer in the sidecar")
                for name, _, rows in round_items:
                    layout = self.layouts[name]
                    if name not in self.direct:  # a direct pool's pages are in place already
                        layout.from_staging(self._stage(), rows, layout.slots)
            if self._on_device():  # the copies into device pages are queued on this thread's stream
                torch.cuda.current_stream().synchronize()
            self.stats["pages_loaded"] += sum(len(keys) for _, keys, _ in items)
            if self.cost is not None:  # the restore cost learns the load's rate
                self.cost.observe_restore(
                    {HOST: sum(len(k) * self.layouts[n].page_bytes for n, k, _ in items)},
                    time.monotonic() - started,
                )
            for layer in range(self.layer_done_counter.num_layers):
                self.layer_done_counter.complete(index, layer)
        except Exception as exc:
            self.stats["load_failures"] += 1
            self._failed("load", exc)
            self.layer_done_counter.fail(index, exc)

    # -- offloads ---------------------------------------------------------------------------
    @_quiet(False)
    def offload(self, transfers, session_id: str | None = None) -> bool:
        """Queue one node's pages; its result is popped in order by the tree."""
        if self._down():
            return False
        expanded = self.pool_group.resolve_transfers(transfers, allow_partial=True)
        items = [(t.name, list(t.keys), page_rows(self.layouts[t.name], t)) for t in expanded]
        if not items or any(rows is None for _, _, rows in items):
            return False
        items = [it for it in items if self.writes(it[0])]
        events = self.record_offload_ready() if self._on_device() else []
        self.offload_queue.put((items, events))
        return True

    def _on_device(self) -> bool:
        return not self.layouts[PoolName.KV].on_cpu

    def _offload_loop(self) -> None:
        """Offloads in order; the nodes queued meanwhile that fit the staging go in one set."""
        carry = None
        while True:
            task, carry = (carry if carry is not None else self.offload_queue.get()), None
            if task is None:
                self.offload_queue.task_done()
                return
            if task is _REGISTER:
                self._register_quietly()
                self.offload_queue.task_done()
                continue
            tasks = [task]
            while not self.offload_queue.empty():
                nxt = self.offload_queue.get_nowait()
                if nxt is None or nxt is _REGISTER or not self._fits(tasks + [nxt]):
                    carry = nxt
                    break
                tasks.append(nxt)
            for ok in self._offload_tasks(tasks):
                self.offload_results.put(ok)
                self.offload_queue.task_done()

    def _fits(self, tasks: list) -> bool:
        """Whether these nodes' pages fit each pool's offload slots at once."""
        need: dict = {}
        for items, _ in tasks:
            for name, keys, _ in items:
                need[name] = need.get(name, 0) + len(keys)
        return all(n <= self.layouts[name].slots for name, n in need.items())

    def _offload_tasks(self, tasks: list) -> list[bool]:
        """Store the nodes' pages; one result per node: every page of it stored."""
        if len(tasks) == 1:
            return [self._offload_one(*tasks[0])]
        try:
            for _, events in tasks:
                gate(events)
            merged = merge_items(items for items, _ in tasks)
            if not merged:
                return [True] * len(tasks)
            self._register()  # which pools go direct is settled before any staging copy
            for name, _, rows in merged:
                if name not in self.direct:
                    self.layouts[name].to_staging(self._stage(), rows, 0)
            stored = self._call(self.client.batch_set, merged, False)
            at: dict[PoolName, int] = {}
            results: list[bool] = []
            for items, _ in tasks:
                ok = True
                for name, keys, _ in items:
                    first = at.get(name, 0)
                    at[name] = first + len(keys)
                    ok = ok and all(stored[self.names[name]][first : first + len(keys)])
                results.append(ok)
            self.stats["pages_offloaded"] += sum(len(keys) for _, keys, _ in merged)
            self.stats["offload_failures"] += results.count(False)
            return results
        except Exception as exc:
            self.stats["offload_failures"] += len(tasks)
            self._failed("offload", exc)
            return [False] * len(tasks)

    def _offload_one(self, items: list, events: list) -> bool:
        """Copy the node's pages into staging, then store them (in rounds when they do not fit
        at once): True when every page is stored."""
        try:
            gate(events)  # the forward pass wrote these pages: only then may the sidecar copy
            for round_items in self._rounds(items):
                self._register()  # which pools go direct is settled before any staging copy
                for name, _, rows in round_items:
                    if name not in self.direct:
                        self.layouts[name].to_staging(self._stage(), rows, 0)
                stored = self._call(self.client.batch_set, round_items, False)
                if not all(all(v) for v in stored.values()):
                    self.stats["offload_failures"] += 1
                    return False
            self.stats["pages_offloaded"] += sum(len(keys) for _, keys, _ in items)
            return True
        except Exception as exc:
            self.stats["offload_failures"] += 1
            self._failed("offload", exc)
            return False

    def num_completed_offloads(self) -> int:
        return self.offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        try:
            return self.offload_results.get_nowait()
        except queue.Empty:
            return False

    # -- rounds: what fits in the staging slots at once -------------------------------------
    def _rounds(self, items: list):
        """Slices of (pool, keys, rows) that fit each pool's C slots, in order."""
        steps = max(
            (-(-len(keys) // self.layouts[name].slots) for name, keys, _ in items), default=0
        )
        for step in range(steps):
            out = []
            for name, keys, rows in items:
                c = self.layouts[name].slots
                if keys[step * c : (step + 1) * c]:
                    out.append(
                        (name, keys[step * c : (step + 1) * c], rows[step * c : (step + 1) * c])
                    )
            yield out

    def _item(self, name: PoolName, keys: list, rows: list, load: bool) -> dict:
        """A batch item: the device pages themselves (a pool registered by CUDA IPC), or the
        pool's staging slots (the offload half, or the load half)."""
        if name in self.direct:
            return self.direct[name].item(keys, rows)
        first = self.layouts[name].slots if load else 0
        return {
            "namespace": self.names[name],
            "keys": keys,
            "buffer_id": self.buffers[name],
            "slots": list(range(first, first + len(keys))),
        }

    # -- lifecycle --------------------------------------------------------------------------
    def reset(self) -> None:
        """Quiesce: queued loads dropped, everything in flight finished, results dropped."""
        self.pending.clear()
        self.load_queue.join()
        self.offload_queue.join()
        while not self.offload_results.empty():
            self.offload_results.get_nowait()
        self.layer_done_counter.reset()

    def _stage(self) -> torch.Tensor:
        """The staging memfd's bytes; no load or offload runs after `close` drops them."""
        assert self.stage is not None, "the linker is closed"
        return self.stage

    def close(self) -> None:
        try:
            self.reset()
            self.load_queue.put(None)
            self.offload_queue.put(None)
            for t in self.threads:
                t.join(30)
            for name, buffer_id in list(self.buffers.items()):
                with contextlib.suppress(Exception):
                    self.client.release_buffer(self.names[name], buffer_id)
            self.buffers.clear()
            for pool in self.direct.values():
                pool.release(self.client)
            self.client.close_leases()
            self.client.close()
            self.lookups.close()
            self.stage = None
            self.staging.close()
            log.info("kv-sidecar linker stats: %s", self.stats)
        except Exception as exc:
            self._failed("close", exc)
