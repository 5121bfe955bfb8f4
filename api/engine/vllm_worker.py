"""Worker side of the vLLM connector: pages move by slot through a registered buffer.

On CPU, vLLM allocates its KV cache inside the connector's allocation context
(`get_mem_pool_context`): `KvArena` puts that one allocation in a memfd, which the worker
registers with the sidecar, slots = block ids. A load is then one copy, the sidecar's, from
its host pool straight into the KV blocks, before the forward. Saves copy the step's
finished blocks into a staging memfd (SharedBuffer, `staging_blocks` page slots) right after
the forward, and the `set` runs on an I/O thread (a block vLLM frees on preemption may be
reused while a set reads it: never read KV blocks after the step). So a request's blocks
are free the moment vLLM is done with them (`request_finished` never delays their release),
and a step never waits for the sidecar: saves that find no free staging slot (the sets
before them still running) are skipped and counted (`save_skipped`), a later request
saves those blocks. Without the arena (the KV cache allocated elsewhere), loads go through
staging too. On CUDA the KV tensors themselves are registered (cuda_ipc,
`api.engine.cuda_export`) and slots are block ids: no staging, sets run in the step.

    load:  sidecar --get(keys, block ids)--> KV blocks                        (before forward)
           (no arena: sidecar --get--> staging slots --copy--> KV blocks)
    save:  KV blocks --copy--> staging slots --set(keys, slots) on I/O thread--> sidecar
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from api.engine.client import SidecarClient, SidecarError, SidecarUnavailable
from api.engine.shm import SharedBuffer, page_first_chunks
from api.engine.vllm_layout import PageLayout, namespace_name
from api.engine.vllm_scheduler import Transfer
from api.engine.vllm_timeline import OFF, Timeline

log = logging.getLogger("kv_sidecar.vllm")


class KvArena(TorchFunctionMode):
    """vLLM's KV cache allocation context on CPU: a `torch.zeros` of at least `min_bytes` on
    the CPU is made in a memfd (zeroed, so faulted in as `torch.zeros` would) instead of
    private memory. vLLM 0.32 allocates the whole KV cache as one such tensor and views
    every layer over it, so the sidecar can copy pages into the KV blocks themselves."""

    def __init__(self, min_bytes: int = 1 << 20):
        super().__init__()
        self.min_bytes = min_bytes
        self.buffers: list[SharedBuffer] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and set(kwargs) <= {"dtype", "device"}:
            shape = _shape(args)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            device = torch.device(kwargs.get("device") or "cpu")
            if shape is not None and device.type == "cpu":
                count = 1
                for d in shape:
                    count *= d
                nbytes = count * torch.empty((), dtype=dtype).element_size()
                if nbytes >= self.min_bytes:
                    buf = SharedBuffer(nbytes, name="kv-vllm-cache")
                    buf.bytes.zero_()  # fault the pages in now, not in the first forward
                    self.buffers.append(buf)
                    return buf.tensor(shape, dtype)
        return func(*args, **kwargs)

    def holding(self, views) -> SharedBuffer | None:
        """The arena buffer every view lies in, or None."""
        for buf in self.buffers:
            lo, hi = buf.address, buf.address + buf.size
            if all(
                lo <= v.data_ptr()
                and v.data_ptr() + v.stride(0) * (v.shape[0] - 1) + v.shape[1] <= hi
                for v in views
            ):
                return buf
        return None


def _shape(args) -> tuple[int, ...] | None:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    return tuple(args) if args and all(isinstance(a, int) for a in args) else None


def kv_chunks(layout: PageLayout, buf: SharedBuffer) -> list[dict]:
    """The page's chunks in the KV cache itself: view j of block b at its address, adjacent
    chunks merged (a layout that keeps a block's layers together is one chunk a page)."""
    chunks: list[dict] = []
    for v in layout.views:
        c = {"offset": v.data_ptr() - buf.address, "stride": v.stride(0), "size": v.shape[1]}
        last = chunks[-1] if chunks else None
        if last and last["stride"] == c["stride"] and last["offset"] + last["size"] == c["offset"]:
            last["size"] += c["size"]
        else:
            chunks.append(c)
    return chunks


class SlotPool:
    """Free staging slots; `take` waits (bounded) for in-flight saves to give theirs back,
    `try_take` does not wait."""

    def __init__(self, n: int):
        self.capacity = n
        self._free = list(range(n - 1, -1, -1))
        self._cond = threading.Condition()

    def take(self, n: int, timeout: float = 60.0) -> list[int]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= n, timeout):
                raise TimeoutError(f"no {n} free staging slots in {timeout} s")
            return [self._free.pop() for _ in range(n)]

    def try_take(self, n: int) -> list[int] | None:
        """`n` free slots now, or None."""
        with self._cond:
            if len(self._free) < n:
                return None
            return [self._free.pop() for _ in range(n)]

    def give(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()


MAX_SET_TOKENS = 8192  # token ids one set carries for KV events (a JSON body: 32,768 values)


def _meta(t: Transfer, i: int, j: int) -> dict:
    """The KV-event fields of the set of t.keys[i:j] (parent: the key before keys[i])."""
    parent = t.keys[i - 1] if i else t.parent
    meta: dict[str, Any] = {"parent": parent} if parent else {}
    if t.tokens:
        meta["tokens"] = t.tokens[i:j]
    return meta


class WorkerSide:
    """Registration, loads, saves and their reports for one worker (one TP/PP rank)."""

    def __init__(
        self,
        client: SidecarClient,
        layout: PageLayout,
        spec: dict,
        staging_blocks: int,
        kv_buffer: SharedBuffer | None = None,
    ):
        self.client, self.layout, self.spec = client, layout, spec
        self.namespace = namespace_name(spec)
        self.cuda = layout.views[0].is_cuda
        self.kv_buffer = kv_buffer  # the KV cache's own memfd (KvArena): direct loads
        self.kv_buffer_id: str | None = None
        self.staging: SharedBuffer | None = None
        if not self.cuda:
            slots = max(1, min(staging_blocks, layout.num_blocks))
            self.staging = SharedBuffer(slots * layout.page_bytes, name="kv-vllm-staging")
            table = self.staging.tensor((slots, layout.page_bytes))
            self.windows = layout.staging_views(table)
            self.slots = SlotPool(slots)
        self.buffer_id: str | None = None
        self.io = ThreadPoolExecutor(1, "sidecar-save")
        self.lock = threading.Lock()  # the I/O thread's counts
        self.reg_lock = threading.Lock()  # registration (HTTP: never under self.lock)
        self.load_errors: set[int] = set()
        self.failed_reqs: set[str] = set()  # a load failed this step: do not save them
        self.pending: list[Future] = []
        self.stats = {
            "loaded": 0,
            "load_failed": 0,
            "saved": 0,
            "save_failed": 0,
            "save_skipped": 0,  # no free staging slot: the step did not wait
        }
        self._last_warning = 0.0
        self.timings: dict[str, list] = {"restores": [], "prefill": []}  # restore cost's
        self.timeline: Timeline = OFF  # where the time goes (bench-serve's breakdown)

    @property
    def direct(self) -> bool:
        """Loads go straight into the KV blocks (slots = block ids)."""
        return self.cuda or self.kv_buffer is not None

    # -- registration (lazy; again after a sidecar restart) ---------------------------
    def _ensure(self, kv: bool = False) -> str:
        with self.reg_lock:
            if kv and not self.cuda:
                if self.kv_buffer_id is None:
                    self.client.put_namespace(self.namespace, **self.spec)
                    self.kv_buffer_id = self._register_kv()
                return self.kv_buffer_id
            if self.buffer_id is None:
                self.client.put_namespace(self.namespace, **self.spec)
                if self.cuda:
                    from api.engine.cuda_export import register_cuda

                    self.buffer_id = register_cuda(
                        self.client,
                        self.namespace,
                        [v for v in self.layout.views],
                        self.layout.num_blocks,
                    )
                else:
                    assert self.staging is not None, "a CPU worker has its staging memfd"
                    slots = self.slots.capacity
                    self.buffer_id = self.staging.register(
                        self.client,
                        self.namespace,
                        slots,
                        page_first_chunks(self.layout.page_bytes),
                    )
            return self.buffer_id

    def _register_kv(self) -> str:
        """Register the KV cache's memfd: one slot per block, the page's chunks where the
        layers lie. A sidecar that refuses it (4xx) gets loads through staging instead."""
        buf = self.kv_buffer
        assert buf is not None, "kv loads only while `direct` off CUDA: the KV memfd is set"
        try:
            return buf.register(
                self.client, self.namespace, self.layout.num_blocks, kv_chunks(self.layout, buf)
            )
        except SidecarError as exc:
            if exc.status >= 500 or exc.code in ("namespace_not_found",):
                raise
            log.warning(
                "kv-sidecar: the sidecar refused the KV cache buffer (%s): loads go through "
                "the staging memfd",
                exc,
            )
            self.kv_buffer = None
            raise

    def _call(
        self, fn: Callable, keys: list[str], slots: list[int], kv: bool = False, **meta
    ) -> list[bool]:
        """One get/set by slot (`kv`: the slots are KV block ids; `meta`: a set's parent and
        tokens); a lost registration registers again and retries once."""
        for attempt in (0, 1):
            buffer_id = self._ensure(kv)
            try:
                return fn(self.namespace, keys, buffer_id, slots, **meta)
            except (SidecarUnavailable, SidecarError) as exc:
                lost = isinstance(exc, SidecarUnavailable) or exc.code in (
                    "buffer_not_found",
                    "namespace_not_found",
                )
                if lost:
                    with self.reg_lock:
                        self.buffer_id = self.kv_buffer_id = None
                if not lost or attempt:
                    raise
        raise AssertionError("unreachable")

    def _warn(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_warning > 30:
            self._last_warning = now
            log.warning("kv-sidecar %s failed (a miss, vLLM recomputes): %s", what, exc)

    # -- loads: before the forward -----------------------------------------------------
    def load(self, transfers: list[Transfer]) -> None:
        """Load every page of this step; blocks that did not load become load errors."""
        self.failed_reqs = set()
        begun = time.monotonic()
        for t in transfers:
            started = time.monotonic()
            ok = self._load_one(t)
            # `ok` is short (or []) when the load failed: the blocks past it are failed below
            failed = [b for b, good in zip(t.block_ids, ok, strict=False) if not good]
            failed += t.block_ids[len(ok) :]
            if t.tiers and t.keys and not failed:
                self.timing("restores", [t.tiers, time.monotonic() - started])
            self.stats["loaded"] += len(t.block_ids) - len(failed)
            if failed:
                self.stats["load_failed"] += len(failed)
                self.load_errors.update(failed)
                self.failed_reqs.add(t.req_id)
        if transfers and self.timeline.on:
            pages = sum(len(t.keys) for t in transfers)
            self.timeline.add("load", load_s=time.monotonic() - begun, load_pages=pages)

    def _load_one(self, t: Transfer) -> list[bool]:
        if not t.keys:
            return []
        try:
            if self.direct:
                return self._call(self.client.get, t.keys, t.block_ids, kv=True)
            ok: list[bool] = []
            step = self.slots.capacity
            for i in range(0, len(t.keys), step):
                keys, blocks = t.keys[i : i + step], t.block_ids[i : i + step]
                slots = self.slots.take(len(keys))
                try:
                    got = self._call(self.client.get, keys, slots)
                    good = [(s, b) for s, b, g in zip(slots, blocks, got, strict=True) if g]
                    if good:
                        self.layout.from_staging(
                            self.windows, [s for s, _ in good], [b for _, b in good]
                        )
                finally:
                    self.slots.give(slots)
                ok += got
            return ok
        except Exception as exc:
            self._warn("load", exc)
            return []

    # -- saves: after the forward ------------------------------------------------------
    def save(self, transfers: list[Transfer]) -> None:
        """Copy this step's finished blocks out of the KV cache now; set them in the background."""
        begun, before = time.monotonic(), self.stats["save_skipped"]
        for t in transfers:
            if t.req_id in self.failed_reqs or not t.keys:
                continue  # computed on top of a block that did not load: never store it
            try:
                self._save_one(t)
            except Exception as exc:
                self.stats["save_failed"] += len(t.keys)
                self._warn("save", exc)
        self.failed_reqs = set()
        if transfers and self.timeline.on:
            self.timeline.add(
                "save",
                save_s=time.monotonic() - begun,
                save_pages=sum(len(t.keys) for t in transfers),
                skipped=self.stats["save_skipped"] - before,
            )

    def _save_one(self, t: Transfer) -> None:
        if self.cuda:  # the sidecar reads the KV blocks themselves: finish the step's writes first
            torch.cuda.current_stream().synchronize()
            self._count(
                self._call(self.client.set, t.keys, t.block_ids, **_meta(t, 0, len(t.keys)))
            )
            return
        step = self.slots.capacity
        if t.tokens:  # a set's JSON holds at most 32,768 values: its tokens stay well within
            step = max(1, min(step, MAX_SET_TOKENS // max(1, len(t.tokens[0]))))
        for i in range(0, len(t.keys), step):
            keys, blocks = t.keys[i : i + step], t.block_ids[i : i + step]
            meta = _meta(t, i, i + step)
            slots = self.slots.try_take(len(keys))
            if slots is None:  # the sets before still hold the slots: never wait for them
                self.stats["save_skipped"] += len(t.keys) - i
                return
            try:
                self.layout.to_staging(self.windows, blocks, slots)
            except BaseException:
                self.slots.give(slots)
                raise
            self.pending.append(self.io.submit(self._set, keys, slots, meta))
        self.pending = [f for f in self.pending if not f.done()]

    def _set(self, keys: list[str], slots: list[int], meta: dict) -> None:
        started = time.monotonic()
        try:
            self._count(self._call(self.client.set, keys, slots, **meta))
            self.timeline.add("set", set_s=time.monotonic() - started, pages=len(keys))
        except Exception as exc:
            self.stats["save_failed"] += len(keys)
            self._warn("save", exc)
        finally:
            self.slots.give(slots)

    def _count(self, stored: list[bool]) -> None:
        n = sum(1 for s in stored if s)
        with self.lock:  # the I/O thread's counts beside the step's
            self.stats["saved"] += n
            self.stats["save_failed"] += len(stored) - n

    # -- reports -----------------------------------------------------------------------
    def timing(self, kind: str, row: list) -> None:
        """Keep a timing for the scheduler's restore cost (at most 256 a step's report)."""
        rows = self.timings[kind]
        if len(rows) < 256:
            rows.append(row)

    def take_timings(self) -> dict[str, list] | None:
        """The timings since the last call (None when there are none)."""
        if not any(self.timings.values()):
            return None
        out, self.timings = self.timings, {"restores": [], "prefill": []}
        return out

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def drain(self, timeout: float = 30.0) -> None:
        """Wait for the sets in flight (shutdown, preemption on CUDA)."""
        deadline = time.monotonic() + timeout
        for f in list(self.pending):
            with contextlib.suppress(Exception):
                f.result(timeout=max(0.0, deadline - time.monotonic()))
        self.pending = []

    def close(self) -> None:
        self.drain()
        self.io.shutdown(wait=True)
        if self.buffer_id is not None:
            with contextlib.suppress(Exception):
                self.client.release_buffer(self.namespace, self.buffer_id)
        if self.kv_buffer_id is not None:
            with contextlib.suppress(Exception):
                self.client.release_buffer(self.namespace, self.kv_buffer_id)
        self.client.close()
        if self.staging is not None:
            self.windows = []
            self.staging.close()
