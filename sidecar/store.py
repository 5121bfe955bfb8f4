"""The store: namespaces -> page pools (and, later, tiers), engine buffers, page moves.

Index operations run on the event loop thread only; byte copies run in the copy
executor between `reserve`/`pin` and `commit`/`unpin`, so the index needs no lock.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from pools import HostPool, PoolFull
from pools.page_pool import BUSY, PRESENT, Entry
from sidecar.answers import PageAnswer, fill_slot
from sidecar.buffers import Buffer, Sources, open_buffer
from sidecar.controls import Controls
from sidecar.copier import Copier
from sidecar.errors import (
    Conflict,
    Forbidden,
    GeometryMismatch,
    NamespaceNotFound,
    NoRoom,
    TicketNotFound,
    TooMany,
)
from sidecar.joints import Joints
from sidecar.keys import check_key, check_keys
from sidecar.ledger import Ledger
from sidecar.lookup import Lookup
from sidecar.namespace import Counters, Namespace, Ref
from sidecar.peer import Peer
from sidecar.spec import NamespaceSpec, check_name
from sidecar.tenancy import (
    MISSING,
    OPERATOR,
    Caller,
    Directory,
    TcpTenant,
    caller,
    owner_of,
    owner_tag,
    ref_of,
)
from sidecar.tiering import Tiering
from sidecar.transports.base import check_runs, check_slots
from sidecar.turns import reap_later

if TYPE_CHECKING:  # pyzmq and msgspec: the `events` extra
    from sidecar.events import Events

log = logging.getLogger("kv_sidecar.store")
MAX_BUFFERS_PER_NAMESPACE = 64  # an engine registers a few (one per pool and rank)
MAX_BUFFERS = 1024  # each is a mapping or an open fd
MAX_BUFFERS_PER_UID = 256  # one uid's share: the others keep room
RESERVE_TURN = 1024  # slots a set reserves a loop turn


class Store:
    """Every namespace of the process, over one host pool."""

    def __init__(
        self,
        host_pool: HostPool,
        executor: Executor,
        sources: Sources,
        copy_parallel: int = 2,
        tiering: Tiering | None = None,
    ):
        self.host_pool = host_pool
        self.executor = executor
        self.copier = Copier(2 * copy_parallel, copy_parallel)  # one uid: half the threads
        self.tiering = tiering or Tiering([], "none", None, host_pool, executor)
        self.tickets: dict[str, dict[str, Any]] = {}
        self.ledger = Ledger(host_pool)  # what each owner holds busy (sidecar/ledger.py)
        self.sources = sources  # shm dirs, lent fds, the CUDA IPC registry (GPU nodes)
        sources.leases.on_end = self.release_lent
        self.dir = Directory.empty()
        self.namespaces: dict[str, Namespace] = self.dir.by_ref  # by ref (sidecar/tenancy.py)
        self.operator_tcp = False  # TCP callers are the operator (a token guards TCP)
        self.joints = Joints()
        # is this key present? every route asks here (sidecar/lookup.py)
        self.lookup = Lookup(self.namespaces, self.namespace, self.tiering, self.joints)
        self.events: Events | None = None  # with --kv-events
        self.totals = Counters()  # every namespace since start, deleted ones too (the sampler's)
        self.controls = Controls(self)  # operator pins and warm jobs (sidecar/controls/)
        self._base = host_pool.arena.address

    # -- namespaces -------------------------------------------------------------------
    # Routes turn the name a caller sends into a ref (`resolve`, or `ref` where an unknown
    # name means "holds nothing"); every other method takes refs.
    def caller(self, peer: Peer | None, tenant: TcpTenant | None = None) -> Caller:
        return caller(peer, self.operator_tcp, tenant)

    def resolve(self, name: str, who: Caller) -> Ref:
        """The ref of the namespace `name` means to `who`; 404 when none (sidecar/tenancy.py)."""
        ref = self.dir.ref(name, who) if isinstance(name, str) else MISSING
        if ref is MISSING:
            raise NamespaceNotFound(
                f"namespace {str(name)[:140]!r} does not exist; create it "
                f"with PUT /v1/namespaces/{{name}}"
            )
        return ref

    def put_namespace(
        self, name: str, spec: NamespaceSpec, who: Caller = OPERATOR
    ) -> tuple[Namespace, bool]:
        """(namespace, created): the caller's own `name`, one shared with it under the same
        spec, or a new one (`Directory.landing`: 403 on another group). 409: another spec."""
        check_name(name)
        ns, owner = self.dir.landing(name, spec, who), owner_of(who)
        if ns is not None:
            if ns.spec != spec:
                raise Conflict(
                    f"namespace {name!r} exists with a different spec; delete it "
                    f"first or use another name",
                    existing=ns.spec.to_json(),
                )
            if isinstance(who, Peer) and ns.owner != who.uid:
                ns.joined.add(who.uid)  # a member's PUT: from now on its name means this one
            return ns, False
        self.dir.check_room(owner)
        ref = ref_of(name, owner)
        try:
            pool = self.host_pool.create(ref, spec.page_bytes, spec.host_capacity_bytes, owner)
        except PoolFull as exc:
            raise NoRoom(f"host pool cannot hold namespace {name!r}: {exc}") from exc
        except ValueError as exc:
            raise GeometryMismatch(str(exc)) from exc
        ns = Namespace(
            name, spec, pool, spec.identity(name, owner_tag(owner, spec.share_gid)), owner, ref
        )
        if self.tiering.policy == "write_back":
            pool.on_evict = self.tiering.on_evict(ns.identity)
        self.dir.add(ns)
        if self.events is not None:
            self.events.watch(ns, self.tiering.tiers)
        self.controls.created(ns)  # pins kept for it across a restart come back
        return ns, True

    def namespace(self, ref: Ref) -> Namespace:
        ns = self.namespaces.get(ref)
        if ns is None:
            raise NamespaceNotFound(
                f"namespace {ref[:140]!r} does not exist; create it with "
                f"PUT /v1/namespaces/{{name}}"
            )
        return ns

    async def drop_namespace(self, ref: Ref, who: Caller = OPERATOR) -> Namespace:
        """`delete_namespace` (403 first to anyone but the owner or the operator), its
        pins ended first, CHUNK a loop turn (sidecar/controls/core.py `end_pins`)."""
        self._check_delete(self.namespace(ref), who)
        await self.controls.end_pins(ref)
        return self.delete_namespace(ref, who)

    def _check_delete(self, ns: Namespace, who: Caller) -> None:
        if isinstance(who, Peer) and ns.owner != who.uid:
            raise Forbidden(f"namespace {ns.name!r} is shared with you; only its owner deletes it")

    def delete_namespace(self, ref: Ref, who: Caller = OPERATOR) -> Namespace:
        """Drop a namespace from the host pool (its owner or the operator only); the
        caller drops its tier pages (`drop_tiers`)."""
        ns = self.namespace(ref)
        self._check_delete(ns, who)
        self.dir.remove(ns)
        if self.events is not None:  # before the pool drops its pages: one AllBlocksCleared
            self.events.dropped_namespace(ns)
        self.joints.drop(ref)
        self.controls.forget_namespace(ns)  # its pins end: the pool can drain
        for buf in ns.buffers.values():
            buf.release()
        self.host_pool.drop(ref)
        reap_later(ns.pool)
        return ns

    def count_skipped(self, ref: Ref, who: Caller, loads: int, pages: int) -> int:
        """An engine recomputed `loads` prefixes (`pages` pages) rather than restore them
        (api/engine/restore_cost.py): counted on its own namespace only. The new total."""
        ns = self.namespace(ref)
        if isinstance(who, Peer) and ns.owner != who.uid:
            raise Forbidden(
                f"namespace {ns.name!r} is shared with you; only its owner counts on it"
            )
        for c in (ns.counters, self.totals):
            c.restores_skipped += loads
            c.restore_pages_skipped += pages
        return ns.counters.restores_skipped

    async def drop_tiers(self, ns: Namespace) -> int:
        """Remove a deleted namespace's tier pages (its queued writes cancelled first),
        unless another namespace has its identity; return the pages a tier kept (failed).
        Its pins kept in the data dir go first."""
        await self.controls.settled(ns)
        if any(o.identity == ns.identity for o in self.namespaces.values()):
            return 0
        return await self.tiering.drop(ns.identity)

    # -- buffers ----------------------------------------------------------------------
    async def register_buffer(self, ref: Ref, body: Any, peer: Peer | None = None) -> Buffer:
        """Map engine memory that `peer` (None: a TCP caller) proves it owns (off the loop,
        `open_buffer`). Buffers are capped a namespace, a uid and in all (429)."""
        ns = self.namespace(ref)
        quota = self.sources.quota
        if peer is not None:  # a uid's buffers, in every namespace
            held, capped = quota.buffers[peer.uid], True
        else:  # TCP (CUDA IPC only): those of the namespace's owner, but the operator's
            held = sum(len(o.buffers) for o in self.namespaces.values() if o.owner == ns.owner)
            capped = ns.owner is not None
        if (
            len(ns.buffers) >= MAX_BUFFERS_PER_NAMESPACE
            or quota.total_buffers >= MAX_BUFFERS
            or (held >= MAX_BUFFERS_PER_UID and capped)
        ):
            raise TooMany(
                f"at most {MAX_BUFFERS_PER_NAMESPACE} buffers a namespace, "
                f"{MAX_BUFFERS_PER_UID} a user and {MAX_BUFFERS} in all; release "
                f"unused ones first"
            )
        buf = await open_buffer(ref, body, ns.spec.page_bytes, self.sources, peer)
        if self.namespaces.get(ref) is not ns or len(ns.buffers) >= MAX_BUFFERS_PER_NAMESPACE:
            buf.release()  # deleted, or filled by other registrations, while it was mapped
            if self.namespaces.get(ref) is not ns:
                raise NamespaceNotFound(
                    f"namespace {ns.name!r} was deleted during the registration"
                )
            raise TooMany(f"at most {MAX_BUFFERS_PER_NAMESPACE} buffers a namespace")
        ns.buffers[buf.id] = buf
        return buf

    def release_buffer(self, ref: Ref, buffer_id: str, peer: Peer | None = None) -> None:
        ns = self.namespace(ref)
        ns.buffer(buffer_id, peer).release()
        del ns.buffers[buffer_id]

    def release_lent(self, lease_ids: list[str]) -> None:
        """A lender went away: release every buffer registered with its leases."""
        ended = set(lease_ids)
        self._release_where(lambda b: b.lease in ended)

    def reap_dead_buffers(self) -> list[str]:
        """Release the buffers whose owning process has exited; return their ids."""
        return self._release_where(lambda b: not b.owner_alive())

    def _release_where(self, doomed) -> list[str]:
        """Release every buffer `doomed(buffer)` picks: the sidecar's own decision, so no
        caller's ownership is checked. Returns their ids."""
        gone = []
        for ns in self.namespaces.values():
            for buf in [b for b in ns.buffers.values() if doomed(b)]:
                buf.release()
                del ns.buffers[buf.id]
                gone.append(buf.id)
        return gone

    async def delete(self, ref: Ref, keys: Any) -> tuple[int, int]:
        """Drop keys from the host pool and every tier: (keys that were present anywhere,
        keys some tier failed to remove and still holds)."""
        ns = self.namespace(ref)
        was = await self.lookup.present(ref, keys)  # validates (JSON) keys it does not find
        self.controls.forget(ref, keys)  # a pinned page is deleted too, its slot freed
        # from here until the tier delete ends, no promotion (a warm, a get) brings them back
        self.tiering.deleting(ns.pool, keys)
        for k in keys:
            ns.pool.delete(k)
        failed = await self.tiering.delete(ns.identity, keys, ns.pool)
        return sum(was), failed

    # -- page moves through engine buffers --------------------------------------------
    def check_move(
        self, ref: Ref, keys: Any, buffer_id: Any, slots: Any, peer: Peer | None = None
    ) -> tuple[Namespace, Buffer]:
        """Validate a set/get before anything moves: namespace, keys, buffer, slots."""
        ns = self.namespace(ref)
        check_keys(keys)
        buf = ns.buffer(buffer_id, peer)
        check_slots(slots, len(keys), buf.slots)
        check_runs(len(keys), len(buf.chunks))
        return ns, buf

    async def set(
        self,
        ref: Ref,
        keys: Any,
        buffer_id: Any,
        slots: Any,
        durable: bool = False,
        peer: Peer | None = None,
        meta: tuple | None = None,
    ) -> list[bool]:
        """Copy pages from engine slots into the host pool; present keys are True, no copy.
        `keys`, `buffer_id`, `slots`: a request's JSON, validated here (`check_move`).
        Under write_through a page is True only once it is pinned on the writer's queue
        (in the loop turn of its commit); with `durable`, only once every tier has it.
        `meta`: `events.set_meta` (parent key, token ids per key) for the KV events of the
        pages stored."""
        ns, buf = self.check_move(ref, keys, buffer_id, slots, peer)
        stored, todo, repeats = await self._reserve_all(ns, keys)
        todo, hold = self.ledger.hold_moves(ns.owner, todo, ns.pool.abort)
        try:
            credits = await self.tiering.admit(ns.identity, ns.pool, len(todo))
        except BaseException:  # cancelled while the writer had no room
            for _, e in todo:
                ns.pool.abort(e)
            hold.release()
            raise
        futures: dict[str, Any] = {}

        def settle(ok: bool) -> None:
            """The copy ended: publish (and queue for the tiers) or give the slots back.
            With KV events and a set's parent or tokens, its commits go as one chain."""
            hold.release()
            chain = ok and meta is not None and self.events is not None
            committed = []
            for i, e in todo:
                if ok:
                    stored[i] = ns.pool.commit(e, log=not chain)
                    if stored[i]:
                        committed.append(e)
                else:
                    ns.pool.abort(e)
            if chain and committed:  # (all of `keys` stored, the common case: no positions)
                assert self.events is not None and meta is not None, "a chain without events"
                self.events.stored_chain(
                    ns.pool,
                    keys,
                    None if len(committed) == len(keys) else [i for i, _ in todo if stored[i]],
                    meta,
                )
            if credits:  # (none: no write-through, nothing queued)
                queued = self.tiering.queue_committed(ns.identity, ns.pool, committed, credits)
                futures.update(zip((e.key for e in committed), queued, strict=True))

        await self.copier.copy(
            buf,
            [(self._base + e.offset, slots[i]) for i, e in todo],
            into_engine=False,
            settle=settle,
        )
        for i, first in repeats:
            stored[i] = stored[first]
        ns.counters.stored += len(todo)
        ns.counters.bytes_in += len(todo) * ns.spec.page_bytes
        self.totals.bytes_in += len(todo) * ns.spec.page_bytes
        if durable and self.tiering.writes():
            await self._await_durable(ns, keys, stored, futures)
        return stored

    async def _reserve_all(self, ns: Namespace, keys: list[str]) -> tuple[list[bool], list, list]:
        """Reserve a slot for each key of a set: (stored, todo: (i, entry) to copy,
        repeats: (i, first i) of a key named twice). Present keys are stored already."""
        stored = [False] * len(keys)
        todo: list[tuple[int, Entry]] = []
        mine: dict[str, int] = {}
        repeats: list[tuple[int, int]] = []
        for i, key in enumerate(keys):
            try:
                if i and not i % RESERVE_TURN:  # a 4,096-key set holds no loop turn long
                    await asyncio.sleep(0)
                r = ns.pool.reserve(key)
                if r is None and self.tiering.backlogged():
                    r = await self._reserve_after_writes(ns, key)
            except BaseException:  # cancelled: give back what this set reserved
                for _, e in todo:
                    ns.pool.abort(e)
                raise
            if r is PRESENT:
                stored[i] = True
            elif r is BUSY:  # true only if this request's own copy of the key commits
                if key in mine:
                    repeats.append((i, mine[key]))
            elif r is None:
                ns.counters.no_room += 1
            else:
                mine[key] = i
                todo.append((i, r))
        return stored, todo, repeats

    async def _reserve_after_writes(self, ns: Namespace, key: str):
        """write_back with a full write queue: the pool keeps its unwritten pages, so wait
        for the writer (back-pressure on the engine) and try again; None once the queue has
        room and still no slot is free, or the namespace is gone."""
        r = None
        while r is None and self.tiering.backlogged() and not ns.pool.closed:
            await self.tiering.queue.wait_change()
            r = None if ns.pool.closed else ns.pool.reserve(key)
        return r

    async def _await_durable(
        self, ns: Namespace, keys: list[str], stored: list[bool], futures: dict
    ) -> None:
        for i, key in enumerate(keys):
            if not stored[i]:
                continue
            fut = futures.get(key)
            stored[i] = await fut if fut is not None else self.tiering.durable(ns.identity, key)

    async def get(
        self, ref: Ref, keys: Any, buffer_id: Any, slots: Any, peer: Peer | None = None
    ) -> list[bool]:
        """Copy pages into engine slots, promoting tier-only pages first; misses are False.
        `keys`, `buffer_id`, `slots`: a request's JSON, validated here (`check_move`).
        With tiers, a long get goes in chunks of a quarter of the pool, so promoting its
        pages never needs more free slots than the pool can give."""
        ns, buf = self.check_move(ref, keys, buffer_id, slots, peer)
        step = len(keys) or 1
        if self.tiering.enabled:
            step = max(8, ns.pool.capacity_pages // 4)
        loaded: list[bool] = []
        for i in range(0, len(keys), step):
            if ns.pool.closed or buf.released:  # deleted while this get ran: the rest misses
                loaded += [False] * len(keys[i : i + step])
                continue
            loaded += await self._get_chunk(ns, buf, keys[i : i + step], slots[i : i + step])
        hits = sum(loaded)
        ns.counters.hits += hits
        ns.counters.misses += len(keys) - hits
        ns.counters.bytes_out += hits * ns.spec.page_bytes
        self.totals.hits += hits
        self.totals.misses += len(keys) - hits
        self.totals.bytes_out += hits * ns.spec.page_bytes
        return loaded

    async def _get_chunk(
        self, ns: Namespace, buf: Buffer, keys: list[str], slots: list[int]
    ) -> list[bool]:
        # pin what is here first: promoting the rest must not evict it
        pinned = [ns.pool.pin(k) for k in keys]
        missing = [k for k, e in zip(keys, pinned, strict=True) if e is None]
        if missing and self.tiering.enabled:
            ns.counters.tier_hits += await self.tiering.promote(ns.identity, ns.pool, missing)
            if not ns.pool.closed:
                pinned = [
                    e if e is not None else ns.pool.pin(k)
                    for k, e in zip(keys, pinned, strict=True)
                ]
        busy = [(i, e) for i, e in enumerate(pinned) if e is not None]
        held, hold = self.ledger.hold_moves(ns.owner, busy, ns.pool.unpin)
        if len(held) < len(keys):
            pinned = [None] * len(keys)
            for i, e in held:
                pinned[i] = e

        def settle(ok: bool) -> None:
            hold.release()
            for e in pinned:
                if e is not None:
                    ns.pool.unpin(e)

        ok = await self.copier.copy(
            buf,
            [(self._base + e.offset, slots[i]) for i, e in enumerate(pinned) if e is not None],
            into_engine=True,
            settle=settle,
        )
        return [ok and e is not None for e in pinned]

    # -- inline pages -----------------------------------------------------------------
    async def put_page(self, ref: Ref, key: str, body: AsyncIterator[bytes]) -> bool:
        """Store one page from a byte stream of exactly page_bytes. True: new; False: present."""
        ns = self.namespace(ref)
        check_key(key)
        size = ns.spec.page_bytes
        self.ledger.check_upload(ns.owner)
        r = ns.pool.reserve(key)
        if r is None and self.tiering.backlogged():
            r = await self._reserve_after_writes(ns, key)
        if r is BUSY:
            raise Conflict(f"page {key!r} is being written by another request; retry")
        if r is PRESENT:
            async for _ in body:
                pass
            return False
        if r is None:
            ns.counters.no_room += 1
            raise NoRoom(f"no room for a page in namespace {ref!r}: every slot is in use")
        ok, credits = False, 0
        hold = self.ledger.hold(ns.owner)
        if not hold.take((r.offset,))[0]:
            ns.pool.abort(r)
            raise TooMany("this owner keeps its share of the host pool busy; retry shortly")
        self.ledger.upload(ns.owner, 1)
        try:
            got = await fill_slot(self._base + r.offset, body, size)
            if got != size:
                raise GeometryMismatch(
                    f"page body has {got} bytes; namespace {ref!r} pages are exactly {size} bytes"
                )
            credits = await self.tiering.admit(ns.identity, ns.pool, 1)
            ok = True
        finally:
            self.ledger.upload(ns.owner, -1)
            hold.release()
            if ok:
                ok = ns.pool.commit(r)
            else:
                ns.pool.abort(r)
        if credits:  # queued in the loop turn of the commit (see `set`)
            self.tiering.queue_committed(ns.identity, ns.pool, [r] if ok else [], credits)
        ns.counters.stored += 1
        ns.counters.bytes_in += size
        self.totals.bytes_in += size
        return True

    async def open_page(self, ref: Ref, key: str) -> PageAnswer | None:
        """One page to answer inline, or None: pinned, and charged to its owner's ledger,
        until the answer is out (`PageAnswer.close`); 429 past the owner's bound. The
        bytes go out ANSWER_PIECE at a time, each copied as it is sent, so an answer
        nobody reads holds a slot of its owner's share, never a copy of the page."""
        ns = self.namespace(ref)
        check_key(key)
        if self.tiering.enabled and not ns.pool.contains(key):
            ns.counters.tier_hits += await self.tiering.promote(ns.identity, ns.pool, [key])
        e = ns.pool.pin(key)
        if e is None:
            ns.counters.misses += 1
            self.totals.misses += 1
            return None
        hold = self.ledger.hold(ns.owner)
        if not hold.take((e.offset,))[0]:
            ns.pool.unpin(e)
            raise TooMany(
                "this owner's answers and copies in flight keep its share of the host pool "
                "busy; read the answers (or retry shortly)"
            )
        size = ns.spec.page_bytes
        ns.counters.hits += 1
        ns.counters.bytes_out += size
        self.totals.hits += 1
        self.totals.bytes_out += size
        return PageAnswer(ns.pool, e, hold, self._base + e.offset, size)

    async def flush(self, timeout: float, who: Caller = OPERATOR) -> int:
        """Wait until every page accepted before the call is in every tier (write_back:
        queue the dirty pages of the namespaces `who` reaches first: a peer's own, every
        one for the operator); return the pages still not written."""
        writer = self.tiering.writer
        if writer is None:
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        unqueued = 0
        for ns in list(self.dir.visible(who)):
            unqueued += await self.tiering.write_dirty(ns.identity, ns.pool, deadline)
        return unqueued + await writer.flush(max(0.0, deadline - loop.time()))

    # -- prefetch ---------------------------------------------------------------------
    async def prefetch(self, ref: Ref, keys: Any) -> dict[str, Any]:
        """Start bringing the leading run of present keys up to the host pool (`keys`: a
        request's JSON, validated by the look-up)."""
        ns = self.namespace(ref)
        n = await self.lookup.prefix(ref, keys)
        ticket = "t-" + secrets.token_hex(8)
        state = {"state": "running", "done": 0, "pages": n}
        self.tickets[ticket] = state
        while len(self.tickets) > 4096:
            self.tickets.pop(next(iter(self.tickets)))
        asyncio.get_running_loop().create_task(self._prefetch(ns, keys[:n], state))
        return {"ticket": ticket, "pages": n}

    async def _prefetch(self, ns: Namespace, keys: list[str], state: dict) -> None:
        try:
            for i in range(0, len(keys), 64):
                chunk = keys[i : i + 64]
                ns.counters.tier_hits += await self.tiering.promote(ns.identity, ns.pool, chunk)
                state["done"] = i + sum(ns.pool.present(chunk))
            state["state"] = "done"
        except Exception as exc:  # reported through the ticket, never raised into the loop
            state["state"] = "failed"
            state["error"] = str(exc)

    def ticket(self, ticket: str) -> dict[str, Any]:
        state = self.tickets.get(ticket)
        if state is None:
            raise TicketNotFound(f"prefetch ticket {ticket[:40]!r} is unknown or expired")
        return state
