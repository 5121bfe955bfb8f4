"""The operators' controls themselves: `Controls` pins, unpins, evicts and warms the pages
of a namespace its caller owns (sidecar/controls/__init__.py says who may).

Pins: a pinned page holds one pin of its pool (`PagePool.pin`, a count shared with the
in-flight copies; the controls hold exactly one per pinned page), so it is off the LRU list
(never evicted) and its segment is busy (never reclaimed by another owner's pool). That
holds a whole segment, so a pin is charged to the namespace's owner by the segments its
pinned pages hold: at most PIN_SHARE of the owner's fair share (`bound_segments`), checked
before any page is pinned (all or nothing, 507 `pin_bound`) and again while pins exist
(owners coming shrink the share: the newest pins go first). A pin ends at its TTL, at unpin,
or when its page or namespace is deleted. A pinned page no tier holds is queued for the
tiers at once (`Tiering.write_first`). With a data dir, each change of a namespace's pins is
kept (sidecar/controls/keeper.py; a pin or unpin answers once it is). At most 4,096 keys a
request (the batch bound): pinned, unpinned or deleted CHUNK a loop turn.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from pools import HostPool
from pools.page_pool import Entry, PagePool
from sidecar.controls.keeper import Keeper
from sidecar.controls.selection import Selection
from sidecar.controls.warm import Warmer, WarmJob
from sidecar.errors import Forbidden, NamespaceNotFound, PinBound
from sidecar.ledger import Ledger
from sidecar.lookup import Lookup
from sidecar.namespace import Namespace, Ref
from sidecar.tenancy import OPERATOR, Caller, Directory, owner_of
from sidecar.tiering import Tiering

CHUNK = 512  # keys an evict deletes a step, expired pins ended a loop turn
RECHECK = 1.0  # seconds between checks of the bounds while pins exist
LIST_MAX = 4096  # pins one listing shows


@dataclass(slots=True, eq=False)
class Pin:
    entry: Entry
    pool: PagePool
    owner: Hashable
    expires: float
    seq: int
    due: int = 0  # the whole second whose bucket holds it (`Controls._schedule`)


class Holder(Protocol):
    """What the controls act through: the store that makes them (`sidecar.store.Store`),
    named by this protocol so that the store may import the controls and not the reverse."""

    host_pool: HostPool
    tiering: Tiering
    dir: Directory
    namespaces: dict[str, Namespace]
    lookup: Lookup
    ledger: Ledger

    def namespace(self, ref: Ref) -> Namespace: ...

    async def delete(self, ref: Ref, keys: list[str]) -> tuple[int, int]: ...


class Controls:
    """Every pin and warm job of one store (on the event loop only)."""

    def __init__(self, store: Holder):
        self.store = store
        self.pins: dict[Ref, dict[str, Pin]] = {}  # ns ref -> key -> pin
        # owner -> seq -> (ref, key), oldest first: the newest end first, CHUNK a turn
        self.by_owner: dict[Hashable, dict[int, tuple[Ref, str]]] = {}
        self.live = 0  # pins held
        self.ending: set[asyncio.Task] = set()  # a dropped namespace's pins, ending
        self.emptied: set[str] = set()  # namespaces whose pins `end_pins` ended (a drop)
        self.ledger = store.ledger  # pins are charged there, with the owner's other holds
        self.warming = Warmer(store)  # warm jobs
        self.released = 0  # pins ended by the bound recheck
        self.expired = 0
        # pins by the whole second their TTL ends in: second -> seq -> (ref, key); and a
        # heap of those seconds. An ended pin leaves its bucket at once, so nothing grows
        # with pins ended early and nothing is ever rebuilt in one loop turn.
        self._due: dict[int, dict[int, tuple[Ref, str]]] = {}
        self._seconds: list[int] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self.keeper: Keeper | None = None  # with a data dir: pins kept across a restart
        self.dropped: dict[Namespace, asyncio.Future] = {}  # their records going (`settled`)

    # -- who ---------------------------------------------------------------------------
    def owned(self, ref: Ref, who: Caller) -> Namespace:
        """The namespace `ref` if `who` may control it (the package's docstring), else 403."""
        ns = self.store.namespace(ref)
        if who is not OPERATOR and owner_of(who) != ns.owner:
            raise Forbidden(
                f"namespace {ns.name!r} is not yours; only its owner or the "
                f"operator pins, evicts or warms its pages"
            )
        return ns

    # -- bounds ------------------------------------------------------------------------
    def bound_segments(self, owner: Hashable) -> int:
        """Segments `owner`'s pins may hold: PIN_SHARE of its fair share of the shared
        segments (split among the owners of shared pools, itself counted) and of its own
        explicit segments (sidecar/ledger.py, where every hold of the owner is charged)."""
        return self.ledger.pin_bound(owner)

    def usage(self, owner: Hashable) -> dict[str, int]:
        seg = self.store.host_pool.segment_size
        held = self.ledger.pinned_segments(owner)
        return {
            "pinned_pages": sum(held.values()),
            "held_bytes": len(held) * seg,
            "bound_bytes": self.bound_segments(owner) * seg,
        }

    # -- pins --------------------------------------------------------------------------
    async def pin(self, ref: Ref, who: Caller, sel: Selection, ttl: float) -> dict[str, Any]:
        """Pin the selected pages (tier-only ones promoted first) for `ttl` seconds; a pin
        already there is renewed. All or nothing against the owner's bound (checked before
        the first pin), CHUNK pins a loop turn; each pin checks the bound again (a page that
        moved meanwhile, or a pin of the same owner between two chunks, may leave a request
        pinned in part: `pinned` says how many)."""
        ns = self.owned(ref, who)
        keys = sel.keys
        if sel.chain:
            keys = keys[: await self.store.lookup.prefix(ref, keys)]
        pool = ns.pool
        missing = [k for k in keys if not pool.contains(k)]
        if missing and self.store.tiering.enabled:
            ns.counters.tier_hits += await self.store.tiering.promote(ns.identity, pool, missing)
        if self.store.namespaces.get(ref) is not ns:  # deleted during the promotion
            raise NamespaceNotFound(f"namespace {ns.name!r} was deleted meanwhile")
        mine = self.pins.get(ref, {})
        present = [k for k in keys if k in pool.ready]
        new = [k for k in present if k not in mine]
        bound = self._check_bound(ns, new)
        loop = asyncio.get_running_loop()
        expires = loop.time() + ttl
        for k in present:
            if k in mine and mine[k].expires < expires:
                mine[k].expires = expires  # (its heap entry is pushed on when it comes up)
        pinned = len(present) - len(new)
        for i in range(0, len(new), CHUNK):
            if i:
                await asyncio.sleep(0)
                if self.store.namespaces.get(ref) is not ns:
                    raise NamespaceNotFound(f"namespace {ns.name!r} was deleted meanwhile")
            pinned += sum(self.hold(ref, ns, k, expires, bound) for k in new[i : i + CHUNK])
        queued = self.store.tiering.write_first(ns.identity, pool, new)
        self.arm(loop)
        return {
            "pinned": pinned,
            "missing": len(sel.keys) - pinned,
            "ttl": ttl,
            "queued_for_tiers": queued,
            "persisted": await self._kept(ns),
            **self.usage(ns.owner),
        }

    def _check_bound(self, ns: Namespace, new: list[str]) -> int:
        """The owner's bound in segments; 507 when the pages `new` would go past it."""
        pool = ns.pool
        held = self.ledger.pinned_segments(ns.owner)
        adds = {pool.ready[k].offset // pool.segment_size for k in new} - held.keys()
        bound = self.bound_segments(ns.owner)
        if len(held) + len(adds) > bound or not self.ledger.may_pin(
            ns.owner, adds, bound, self.ledger.bound(ns.owner)
        ):
            seg = self.store.host_pool.segment_size
            raise PinBound(
                f"pinning these pages would hold {(len(held) + len(adds)) * seg} "
                f"bytes of the host pool for this namespace's owner; its bound is "
                f"{bound * seg} (half its fair share): unpin some first",
                **self.usage(ns.owner),
            )
        return bound

    def hold(self, ref: Ref, ns: Namespace, key: str, expires: float, bound: int) -> bool:
        """Pin one page until `expires` (loop time); False when it is gone, pinned already,
        or its segment would put the owner past `bound` (`bound_segments`). Call `arm`
        after a batch of holds: it starts the expiry and bound checks. The pin's record is
        not kept (`pin` and the keeper's restore keep it)."""
        e, mine = ns.pool.ready.get(key), self.pins.get(ref, {})
        if e is None or key in mine:
            return False
        seg = e.offset // ns.pool.segment_size
        if not self.ledger.may_pin(ns.owner, {seg}, bound, self.ledger.bound(ns.owner)):
            return False
        got = ns.pool.pin(key)
        assert got is e, "a ready page could not be pinned"
        pin = Pin(e, ns.pool, ns.owner, expires, next(self._seq))
        self.pins.setdefault(ref, {})[key] = pin
        self.by_owner.setdefault(ns.owner, {})[pin.seq] = (ref, key)
        self.live += 1
        self.ledger.pin(ns.owner, seg)
        self._schedule(pin, ref, key)
        return True

    def _release(self, ref: Ref, key: str) -> bool:
        """End one pin (its pool pin given back); False when there was none."""
        mine = self.pins.get(ref)
        pin = mine.pop(key, None) if mine else None
        if pin is None:
            return False
        if not mine:
            del self.pins[ref]
        self._end(pin)
        return True

    def _end(self, pin: Pin) -> None:
        """A pin out of `self.pins` ends: its ledger charge and pool pin given back."""
        order = self.by_owner[pin.owner]
        order.pop(pin.seq, None)  # (`enforce` took it out already)
        if not order:
            del self.by_owner[pin.owner]
        bucket = self._due.get(pin.due)
        if bucket is not None:  # (an emptied bucket stays until its second: one a second)
            bucket.pop(pin.seq, None)
        self.live -= 1
        self.ledger.unpin(pin.owner, pin.entry.offset // self.store.host_pool.segment_size)
        pin.pool.unpin(pin.entry)  # (a page deleted meanwhile is buried now)

    async def unpin(self, ref: Ref, who: Caller, sel: Selection | None) -> dict[str, Any]:
        """End the pins of the selected pages (None: every pin of the namespace), CHUNK a
        loop turn."""
        ns = self.owned(ref, who)
        keys = list(self.pins.get(ref, {})) if sel is None else sel.keys
        n = 0
        for i in range(0, len(keys), CHUNK):
            if i:
                await asyncio.sleep(0)
            n += sum(self._release(ref, k) for k in keys[i : i + CHUNK])
        return {"unpinned": n, "persisted": await self._kept(ns), **self.usage(ns.owner)}

    def listing(self, ref: Ref, who: Caller, label: str) -> dict[str, Any]:
        """One namespace's pins (the first LIST_MAX), with the owner's usage."""
        ns = self.store.namespace(ref)
        now = asyncio.get_running_loop().time()
        mine = self.pins.get(ref, {})
        shown = [
            {"key": k, "expires_in": round(max(p.expires - now, 0.0), 3)}
            for k, p in itertools.islice(mine.items(), LIST_MAX)
        ]
        return {
            "namespace": label,
            "pins": shown,
            "more": max(len(mine) - LIST_MAX, 0),
            "restoring": self.keeper is not None and ns in self.keeper.restoring,
            "pages": len(mine),
            "bytes": len(mine) * ns.spec.page_bytes,
            # the owner's pins of every namespace: for it and the operator, not its sharers
            **(self.usage(ns.owner) if who is OPERATOR or owner_of(who) == ns.owner else {}),
        }

    def summary(self, who: Caller) -> dict[str, Any]:
        """Pins of every namespace `who` reaches: pages and bytes each, warm jobs."""
        d = self.store.dir
        spaces = {
            d.label(ns, who): {
                "pages": len(self.pins[ns.ref]),
                "bytes": len(self.pins[ns.ref]) * ns.spec.page_bytes,
            }
            for ns in d.visible(who)
            if ns.ref in self.pins
        }
        return {
            "namespaces": spaces,
            "warm": self.warming.visible(who),
            "expired": self.expired,
            "released_over_bound": self.released,
            "kept": None if self.keeper is None else self.keeper.describe(),
        }

    # -- hooks from the store ------------------------------------------------------------
    def forget(self, ref: Ref, keys: list[str]) -> None:
        """Pages are being deleted: their pins end first (their slots then free at once)."""
        if ref in self.pins and sum(self._release(ref, k) for k in keys):
            self._touch({ref})

    def forget_namespace(self, ns: Namespace) -> None:
        """A namespace is being dropped: its pins end (its pool then drains), its restore
        and jobs stop; its kept pins go (a shutdown, `close`d first, keeps them)."""
        restoring = self.keeper is not None and self.keeper.stop(ns)
        kept = restoring or ns.ref in self.pins or ns.ref in self.emptied
        self.emptied.discard(ns.ref)
        mine = self.pins.pop(ns.ref, {})  # out of every view now; ended CHUNK a loop turn
        if len(mine) <= CHUNK:
            for pin in mine.values():
                self._end(pin)
        else:
            task = asyncio.get_running_loop().create_task(self._end_all(list(mine.values())))
            self.ending.add(task)
            task.add_done_callback(self.ending.discard)
        fut = self._keep(ns) if kept else None
        if fut is not None:
            self.dropped[ns] = fut
        self.warming.cancel(ns)

    async def end_pins(self, ref: Ref) -> None:
        """Before a namespace is dropped: end its pins, CHUNK a loop turn (its pool then
        closes with only in-flight copies busy: no walk of a million pinned pages)."""
        while self.pins.get(ref):
            self.emptied.add(ref)
            for k in list(itertools.islice(self.pins[ref], CHUNK)):
                self._release(ref, k)
            await asyncio.sleep(0)

    async def _end_all(self, pins: list[Pin]) -> None:
        for i in range(0, len(pins), CHUNK):
            if i:
                await asyncio.sleep(0)
            for pin in pins[i : i + CHUNK]:
                self._end(pin)

    # -- kept across a restart (sidecar/controls/keeper.py) -----------------------------
    def _keep(self, ns: Namespace) -> asyncio.Future | None:
        return None if self.keeper is None else self.keeper.keep(ns)

    async def _kept(self, ns: Namespace) -> bool:
        """Keep `ns`'s pins as they are now: whether the data dir holds them (False: none)."""
        fut = self._keep(ns)
        return fut is not None and await fut

    def _touch(self, refs: set[Ref]) -> None:
        for ref in refs:
            ns = self.store.namespaces.get(ref)
            if ns is not None:
                self._keep(ns)

    def created(self, ns: Namespace) -> None:
        """A namespace was made: the pins kept for it come back (with a data dir)."""
        if self.keeper is not None:
            self.keeper.restore(ns)

    async def settled(self, ns: Namespace) -> None:
        """After `forget_namespace`: once its kept pins are gone (a delete sticks)."""
        fut = self.dropped.pop(ns, None)
        if fut is not None:
            await fut

    async def close(self, timeout: float) -> None:
        """Shutdown: pins kept as they are; the namespaces it then drops keep theirs."""
        if self.keeper is not None:
            await self.keeper.close(timeout)

    # -- expiry and bounds ---------------------------------------------------------------
    def arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """Check pins' TTLs and the owners' bounds while pins exist: at the first TTL to
        end or in RECHECK seconds (the checks go on alone once armed; no-op when armed)."""
        if self._timer is not None or not self.pins:
            return
        now = loop.time()
        at = min(self._seconds[0], now + RECHECK) if self._seconds else now + RECHECK
        self._timer = loop.call_at(at, self._tick)

    def _tick(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        more = self.expire(loop.time()) + self.enforce() >= CHUNK
        if more and self.pins:  # the rest on the loop's next turns, CHUNK a turn
            self._timer = loop.call_at(loop.time(), self._tick)
            return
        self.arm(loop)

    def expire(self, now: float) -> int:
        """End every pin whose TTL passed by `now` (CHUNK of them a loop turn at most: the
        rest at the next tick); the pins ended."""
        n, ended = 0, set()
        for seq, ref, key in self._come_due(now):
            pin = self.pins.get(ref, {}).get(key)
            if pin is None or pin.seq != seq:
                continue  # ended before its TTL
            if pin.expires > now:  # renewed: its one entry goes back, later
                self._schedule(pin, ref, key)
                continue
            self._release(ref, key)
            ended.add(ref)
            n += 1
        self.expired += n
        self._touch(ended)
        return n

    def _schedule(self, pin: Pin, ref: Ref, key: str) -> None:
        pin.due = math.ceil(pin.expires)
        bucket = self._due.get(pin.due)
        if bucket is None:
            bucket = self._due[pin.due] = {}
            heapq.heappush(self._seconds, pin.due)
        bucket[pin.seq] = (ref, key)

    def _come_due(self, now: float) -> list[tuple[int, Ref, str]]:
        """At most CHUNK (seq, ref, key) out of the buckets of seconds up to `now`."""
        out: list[tuple[int, Ref, str]] = []
        while self._seconds and self._seconds[0] <= now and len(out) < CHUNK:
            second = self._seconds[0]
            bucket = self._due.get(second)
            while bucket and len(out) < CHUNK:
                seq, (ref, key) = bucket.popitem()
                out.append((seq, ref, key))
            if not bucket:
                heapq.heappop(self._seconds)
                self._due.pop(second, None)
        return out

    def enforce(self) -> int:
        """Owners whose pins hold more segments than their bound (the share shrank as
        owners came) lose their newest pins until within it, CHUNK pins a call at most
        (`_tick` calls again on the next turn while there are more); the pins ended."""
        n, ended = 0, set()
        for owner in list(self.by_owner):
            bound = self.ledger.pin_bound(owner)
            order = self.by_owner.get(owner)
            while order and n < CHUNK and len(self.ledger.pinned_segments(owner)) > bound:
                _, (ref, k) = order.popitem()  # the newest (O(1), unlike reversed())
                n += self._release(ref, k)
                ended.add(ref)
                order = self.by_owner.get(owner)
            if n >= CHUNK:
                break
        self.released += n
        self._touch(ended)
        return n

    # -- evict -----------------------------------------------------------------------------
    async def evict(self, ref: Ref, who: Caller, sel: Selection) -> dict[str, Any]:
        """Delete the selected pages from the host pool and every tier (as per-key deletes:
        their files go, so the delete holds across a restart), CHUNK keys at a time."""
        self.owned(ref, who)
        deleted = failed = 0
        for i in range(0, len(sel.keys), CHUNK):
            d, f = await self.store.delete(ref, sel.keys[i : i + CHUNK])
            deleted, failed = deleted + d, failed + f
        return {"deleted": deleted, "failed": failed}

    # -- warm ------------------------------------------------------------------------------
    @property
    def jobs(self) -> dict[str, WarmJob]:
        """Every warm job, by id (sidecar/controls/warm.py)."""
        return self.warming.jobs

    async def warm(self, ref: Ref, who: Caller, sel: Selection) -> dict[str, Any]:
        """Start a job bringing the selected pages present in some tier into the host pool
        (a chain: its leading run of present pages). 429 past WARM_RUNNING_PER_OWNER."""
        ns = self.owned(ref, who)
        self.warming.check_room(ns.owner)
        if sel.chain:
            keys = sel.keys[: await self.store.lookup.prefix(ref, sel.keys)]
        else:
            keys = [
                k
                for k, hit in zip(
                    sel.keys, await self.store.lookup.present(ref, sel.keys), strict=True
                )
                if hit
            ]
        job = self.warming.start(self.owned(ref, who), keys)
        return {"job": job.id, "pages": len(keys)}

    def job(self, job_id: str, who: Caller) -> dict[str, Any]:
        return self.warming.job(job_id, who)
