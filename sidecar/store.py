"""The store: namespaces -> page pools (and, later, tiers), engine buffers, page moves.

Index operations run on the event loop thread only; byte copies run in the copy
executor between `reserve`/`pin` and `commit`/`unpin`, so the index needs no lock.
"""
from __future__ import annotations

import asyncio
import ctypes
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

from pools import HostPool, PagePool, PoolFull
from pools.page_pool import PRESENT, Entry
from sidecar.buffers import Buffer, open_buffer
from sidecar.errors import (BufferNotFound, Conflict, GeometryMismatch, NamespaceNotFound,
                            NoRoom)
from sidecar.keys import check_batch, check_key, check_keys
from sidecar.spec import NamespaceSpec, check_name
from sidecar.transports.base import check_slots, coalesce, page_runs, split_plan
from sidecar.transports.shm import run_plan


@dataclass(slots=True)
class Counters:
    """Per-namespace totals since start (exported by /v1/stats and /metrics)."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    no_room: int = 0


@dataclass(slots=True, eq=False)
class Namespace:
    name: str
    spec: NamespaceSpec
    pool: PagePool
    buffers: dict[str, Buffer] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)

    def buffer(self, buffer_id: Any) -> Buffer:
        buf = self.buffers.get(buffer_id) if isinstance(buffer_id, str) else None
        if buf is None:
            raise BufferNotFound(f"buffer {str(buffer_id)[:40]!r} is not registered in "
                                 f"namespace {self.name!r}; register it with POST .../buffers")
        return buf


class Store:
    """Every namespace of the process, over one host pool."""

    def __init__(self, host_pool: HostPool, executor: Executor, shm_dirs: Sequence[str],
                 copy_parallel: int = 2):
        self.host_pool = host_pool
        self.executor = executor
        self.copy_parallel = copy_parallel
        self.shm_dirs = tuple(shm_dirs)
        self.namespaces: dict[str, Namespace] = {}
        self._base = host_pool.arena.address

    # -- namespaces -------------------------------------------------------------------
    def put_namespace(self, name: str, spec: NamespaceSpec) -> bool:
        """Create; True when new, False when the same spec was there. 409 on a different one."""
        check_name(name)
        ns = self.namespaces.get(name)
        if ns is not None:
            if ns.spec != spec:
                raise Conflict(f"namespace {name!r} exists with a different spec; delete it "
                               f"first or use another name", existing=ns.spec.to_json())
            return False
        try:
            pool = self.host_pool.create(name, spec.page_bytes, spec.host_capacity_bytes)
        except PoolFull as exc:
            raise NoRoom(f"host pool cannot hold namespace {name!r}: {exc}") from exc
        except ValueError as exc:
            raise GeometryMismatch(str(exc)) from exc
        self.namespaces[name] = Namespace(name, spec, pool)
        return True

    def namespace(self, name: str) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            raise NamespaceNotFound(f"namespace {name[:140]!r} does not exist; create it with "
                                    f"PUT /v1/namespaces/{{name}}")
        return ns

    def delete_namespace(self, name: str) -> None:
        ns = self.namespace(name)
        del self.namespaces[name]
        for buf in ns.buffers.values():
            buf.release()
        self.host_pool.drop(name)

    # -- buffers ----------------------------------------------------------------------
    def register_buffer(self, name: str, body: Any) -> Buffer:
        ns = self.namespace(name)
        buf = open_buffer(name, body, ns.spec.page_bytes, self.shm_dirs)
        ns.buffers[buf.id] = buf
        return buf

    def release_buffer(self, name: str, buffer_id: str) -> None:
        ns = self.namespace(name)
        ns.buffer(buffer_id).release()
        del ns.buffers[buffer_id]

    def reap_dead_buffers(self) -> list[str]:
        """Release the buffers whose owning process has exited; return their ids."""
        dead = []
        for ns in self.namespaces.values():
            for buf in [b for b in ns.buffers.values() if not b.owner_alive()]:
                self.release_buffer(ns.name, buf.id)
                dead.append(buf.id)
        return dead

    # -- lookups ----------------------------------------------------------------------
    # A key found in the index was validated when it was stored, so look-ups validate only
    # the keys they do not find (an unhashable entry falls through to the full check).
    def prefix(self, name: str, keys: list[str]) -> int:
        pool = self.namespace(name).pool
        try:
            n = pool.prefix(check_batch(keys))
        except TypeError:
            n = 0
        check_keys(keys[n:])
        return n

    def present(self, name: str, keys: list[str]) -> list[bool]:
        pool = self.namespace(name).pool
        try:
            found = pool.present(check_batch(keys))
        except TypeError:
            check_keys(keys)
            raise AssertionError("an unhashable key passed validation")
        check_keys([k for k, hit in zip(keys, found) if not hit])
        return found

    def delete(self, name: str, keys: list[str]) -> int:
        pool = self.namespace(name).pool
        return sum(pool.delete(k) for k in check_keys(keys))

    # -- page moves through engine buffers --------------------------------------------
    def check_move(self, name: str, keys: Any, buffer_id: Any, slots: Any) -> tuple[Namespace, Buffer]:
        """Validate a set/get before anything moves: namespace, keys, buffer, slots."""
        ns = self.namespace(name)
        check_keys(keys)
        buf = ns.buffer(buffer_id)
        check_slots(slots, len(keys), buf.slots)
        return ns, buf

    async def set(self, name: str, keys: list[str], buffer_id: Any, slots: Any) -> list[bool]:
        """Copy pages from engine slots into the host pool; present keys are True, no copy."""
        ns, buf = self.check_move(name, keys, buffer_id, slots)
        stored, todo = [False] * len(keys), []
        for i, key in enumerate(keys):
            r = ns.pool.reserve(key)
            if r is PRESENT:
                stored[i] = True
            elif r is None:
                ns.counters.no_room += 1
            else:
                todo.append((i, r))
        plan = [(self._base + e.offset + off, src, n)
                for i, e in todo for src, off, n in page_runs(buf.chunks, buf.address, slots[i])]
        ok = False
        try:
            await self._copy(buf, plan)
            ok = True
        finally:
            for i, e in todo:
                if ok:
                    stored[i] = ns.pool.commit(e)
                else:
                    ns.pool.abort(e)
        ns.counters.stored += len(todo)
        ns.counters.bytes_in += len(todo) * ns.spec.page_bytes
        return stored

    async def get(self, name: str, keys: list[str], buffer_id: Any, slots: Any) -> list[bool]:
        """Copy host-pool pages into engine slots; misses are False."""
        ns, buf = self.check_move(name, keys, buffer_id, slots)
        pinned = [ns.pool.pin(k) for k in keys]
        plan = [(dst, self._base + e.offset + off, n)
                for i, e in enumerate(pinned) if e is not None
                for dst, off, n in page_runs(buf.chunks, buf.address, slots[i])]
        try:
            await self._copy(buf, plan)
        finally:
            for e in pinned:
                if e is not None:
                    ns.pool.unpin(e)
        loaded = [e is not None for e in pinned]
        hits = sum(loaded)
        ns.counters.hits += hits
        ns.counters.misses += len(keys) - hits
        ns.counters.bytes_out += hits * ns.spec.page_bytes
        return loaded

    async def _copy(self, buf: Buffer, plan: list) -> None:
        """Run a plan in the executor, large ones in parallel slices; a cancelled request
        still waits for every slice to end before its slots are released."""
        if not plan:
            return
        buf.acquire()
        try:
            loop = asyncio.get_running_loop()
            futs = [loop.run_in_executor(self.executor, run_plan, part)
                    for part in split_plan(coalesce(plan), self.copy_parallel)]
            try:
                await asyncio.shield(asyncio.gather(*futs))
            except asyncio.CancelledError:
                await asyncio.wait(futs)
                raise
        finally:
            buf.release_ref()

    # -- inline pages -----------------------------------------------------------------
    async def put_page(self, name: str, key: str, body: AsyncIterator[bytes]) -> bool:
        """Store one page from a byte stream of exactly page_bytes. True: new; False: present."""
        ns = self.namespace(name)
        check_key(key)
        size = ns.spec.page_bytes
        r = ns.pool.reserve(key)
        if r is PRESENT:
            async for _ in body:
                pass
            return False
        if r is None:
            ns.counters.no_room += 1
            raise NoRoom(f"no room for a page in namespace {name!r}: every slot is in use")
        ok = False
        try:
            got = await self._fill(r, body, size)
            if got != size:
                raise GeometryMismatch(f"page body has {got} bytes; namespace {name!r} pages "
                                       f"are exactly {size} bytes")
            ok = True
        finally:
            ns.pool.commit(r) if ok else ns.pool.abort(r)
        ns.counters.stored += 1
        ns.counters.bytes_in += size
        return True

    async def _fill(self, e: Entry, body: AsyncIterator[bytes], size: int) -> int:
        got, dst = 0, self._base + e.offset
        async for chunk in body:
            n = len(chunk)
            if got + n > size:
                return got + n
            ctypes.memmove(dst + got, chunk, n)
            got += n
        return got

    def read_page(self, name: str, key: str) -> Optional[bytearray]:
        """A copy of one page, or None (pinned only for the copy: the transport may keep
        the response buffer after the request ends, so it must not alias a slot)."""
        ns = self.namespace(name)
        check_key(key)
        e = ns.pool.pin(key)
        if e is None:
            ns.counters.misses += 1
            return None
        try:
            out = bytearray(ns.spec.page_bytes)
            ctypes.memmove((ctypes.c_char * len(out)).from_buffer(out), self._base + e.offset, len(out))
        finally:
            ns.pool.unpin(e)
        ns.counters.hits += 1
        ns.counters.bytes_out += len(out)
        return out

    # -- observation ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        hp = self.host_pool
        spaces = {}
        for name, ns in self.namespaces.items():
            c, pool = ns.counters, ns.pool
            spaces[name] = {
                "pool": ns.spec.pool, "page_bytes": ns.spec.page_bytes,
                "pages": {"host": pool.ready_pages}, "capacity_pages": pool.capacity_pages,
                "capacity_bytes": pool.capacity_pages * ns.spec.page_bytes,
                "hits": c.hits, "misses": c.misses, "evictions": pool.evictions,
                "stored": c.stored, "no_room": c.no_room, "buffers": len(ns.buffers),
                "bytes_in": c.bytes_in, "bytes_out": c.bytes_out}
        return {"host_pool": {"bytes": hp.arena.size, "segment_size": hp.segment_size,
                              "segments": hp.n_segments, "free_segments": len(hp.free_segments)},
                "namespaces": spaces}
