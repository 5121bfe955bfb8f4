"""The host pool: one arena cut into equal segments, lent to namespaces' page pools.

    arena: | seg 0: ns A | seg 1: ns B | seg 2: free | seg 3: ns A | ... |

Every pool has an `owner` (a tenant: the sidecar passes a uid; None is the operator).
A namespace created with an explicit capacity gets all its segments at once and never
more (its LRU is exact at that many pages). The others share the remaining segments and
grow on demand, fairly by owner first, then by pool within an owner:

    owner share = shared segments / owners of shared pools
    pool share  = its owner's share / that owner's shared pools

A pool grows from the free list, else, while its owner and itself are below their
shares, by reclaiming the coldest idle segment of a pool whose owner holds more than its
share (the owner furthest above first), else of a pool of its own owner above its pool
share; past that it evicts its own least recent page. A pool holding no segment may
always take one, so the N+1th namespace stores even when N hold every segment: from
another owner only while its own owner is below the owner share, else from its own
owner's pools. One tenant with many namespaces gets one owner's share, not one share a
namespace, and making more does not cost its neighbours a segment each.

Tenants' explicit capacities hold at most half the segments in all, each tenant at most
its part of that half (split among the tenants holding a pool at the time), so the shared
segments never drop below half; they take free segments, their owner's own shared ones,
and those of owners above their share only: never another tenant's share (PoolFull
otherwise). The operator (owner None) is not capped.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable

from pools.arena import Arena
from pools.page_pool import PagePool, PoolInvariantError

RESERVED_SHARE = 0.5  # of the segments, at most, reserved by tenants (explicit capacities)
RECLAIM_RETRY = 64  # grows a pool skips the reclaim after one found nothing
# (owner share, shared pools by owner, shared segments held by owner): `HostPool._counts`
Shares = tuple[float, Counter[Hashable], Counter[Hashable]]


class PoolFull(Exception):
    """An explicit share cannot be carved out of what is still free."""


class HostPool:
    """Segments of one arena, lent to named page pools."""

    def __init__(self, arena: Arena, segment_size: int):
        if segment_size <= 0 or segment_size > arena.size:
            raise ValueError(f"segment size {segment_size} must be in 1..{arena.size}")
        self.arena = arena
        self.segment_size = segment_size
        self.n_segments = arena.size // segment_size
        self.free_segments: list[int] = list(reversed(range(self.n_segments)))
        self.pools: dict[str, PagePool] = {}
        self.draining: list[PagePool] = []
        self.explicit_segments = 0
        self._shares: Shares | None = None  # `_counts`, until segments move
        self._explicit: Counter[Hashable] | None = None  # explicit segments by owner, likewise
        self._no_reclaim: dict[str, int] = {}  # pool -> grows left to skip (see `_grow`)

    # -- namespaces -------------------------------------------------------------------
    def create(
        self, name: str, page_bytes: int, capacity_bytes: int | None = None, owner: Hashable = None
    ) -> PagePool:
        """A page pool for `name` of `owner`: a fixed share of `capacity_bytes`, or a fair share."""
        if name in self.pools:
            raise ValueError(f"pool {name!r} exists")
        if page_bytes <= 0 or page_bytes > self.segment_size:
            raise ValueError(
                f"page_bytes {page_bytes} is larger than the segment size "
                f"{self.segment_size}; start with a larger --segment-size"
            )
        if capacity_bytes is None:
            pool = PagePool(name, page_bytes, self.segment_size, grow=self._grow)
            pool.owner = owner
        else:
            pool = self._create_explicit(name, page_bytes, capacity_bytes, owner)
        pool.on_idle = self._release
        pool.on_segment_idle = self._segment_idle
        self.pools[name] = pool
        self._moved()
        return pool

    def _create_explicit(
        self, name: str, page_bytes: int, capacity_bytes: int, owner: Hashable
    ) -> PagePool:
        pages = capacity_bytes // page_bytes
        if pages < 1:
            raise ValueError(f"capacity {capacity_bytes} holds no page of {page_bytes} bytes")
        pool = PagePool(name, page_bytes, self.segment_size, max_pages=pages)
        pool.owner = owner
        need = math.ceil(pages / pool.slots_per_segment)
        if owner is not None:
            self._check_reserved_share(owner, need)
        victims = self._victims_for(owner, need) if len(self.free_segments) < need else []
        idle = sum(min(p.idle_segments(), room) for p, room in victims)
        if len(self.free_segments) + idle < need:  # fail before evicting anything
            raise PoolFull(
                f"{need} segments needed for {capacity_bytes} bytes, "
                f"{len(self.free_segments)} free and {idle} reclaimable"
            )
        for victim, room in victims:
            while len(self.free_segments) < need and room > 0:
                seg = victim.reclaim_segment()
                if seg is None:
                    break
                self.free_segments.append(seg)
                self._moved()
                room -= 1
        if len(self.free_segments) < need:  # write-back kept pages it could not queue yet
            raise PoolFull(
                f"{need} segments needed for {capacity_bytes} bytes; shared "
                f"namespaces hold pages not yet written back: retry"
            )
        for _ in range(need):
            pool.add_segment(self.free_segments.pop())
        self.explicit_segments += need
        self._moved()
        return pool

    def _check_reserved_share(self, owner: Hashable, need: int) -> None:
        """Tenants reserve at most RESERVED_SHARE of the segments in all, and each at most
        its part of that (split among the tenants that hold a pool now): the shared
        segments, which every tenant's pools grow into, never drop below the rest."""
        explicit = [
            p for p in self.pools.values() if p.owner is not None and p.max_pages is not None
        ]
        tenants = {p.owner for p in self.pools.values() if p.owner is not None} | {owner}
        total = RESERVED_SHARE * self.n_segments
        cap = total / len(tenants)
        mine = sum(len(p.segments) for p in explicit if p.owner == owner)
        if mine + need > cap or sum(len(p.segments) for p in explicit) + need > total:
            raise PoolFull(
                f"{need} more reserved segments would put this tenant over its share "
                f"({cap:.1f} of {self.n_segments}: half the host pool split among "
                f"{len(tenants)} tenants) or the tenants over half the host pool"
            )

    def _victims_for(self, owner: Hashable, need: int) -> list[tuple[PagePool, int]]:
        """(shared pool, segments it may give) an explicit share of `owner` may reclaim,
        largest first: for the operator any; for a tenant its own, and the segments of
        other owners above their share as it will be once `need` more are explicit."""
        shared = sorted(self.shared_pools(), key=lambda p: len(p.segments), reverse=True)
        if owner is None:
            return [(p, len(p.segments)) for p in shared]
        owners = {p.owner for p in shared}
        share = (self.n_segments - self.explicit_segments - need) / max(len(owners), 1)
        above = {o: self._held(o) - share for o in owners if o != owner}
        out = []
        for p in shared:
            if p.owner == owner:
                out.append((p, len(p.segments)))
            elif above.get(p.owner, 0) >= 1:
                room = min(len(p.segments), int(above[p.owner]))
                above[p.owner] -= room
                out.append((p, room))
        return out

    def drop(self, name: str) -> None:
        """Remove a pool; its segments return once no copy holds one of its slots."""
        pool = self.pools.pop(name)
        self._no_reclaim.pop(name, None)
        if pool.max_pages is not None:
            self.explicit_segments -= len(pool.segments)
        self.draining.append(pool)
        self._moved()
        pool.close()

    def _release(self, pool: PagePool) -> None:
        if pool in self.draining:
            self.draining.remove(pool)
            self.free_segments.extend(pool.segments)
            pool.segments.clear()
            pool.clear_free()
            self._moved()

    # -- growth -----------------------------------------------------------------------
    def shared_pools(self) -> list[PagePool]:
        return [p for p in self.pools.values() if p.max_pages is None]

    def fair_share(self) -> float:
        """Segments each shared pool may hold when every pool has one owner."""
        shared = len(self.shared_pools())
        return (self.n_segments - self.explicit_segments) / max(shared, 1)

    def owner_bound(self, owner: Hashable) -> float:
        """Segments `owner` may hold busy in fairness (pins, copies, answers, uploads:
        sidecar/ledger.py): the shared segments split among the owners of shared pools,
        itself counted, plus its own explicit segments. Counted once after each change."""
        _, pools, _ = self._counts()
        if self._explicit is None:
            self._explicit = Counter()
            for p in self.pools.values():
                if p.max_pages is not None:
                    self._explicit[p.owner] += len(p.segments)
        sharers = len(pools) + (owner not in pools)
        return (self.n_segments - self.explicit_segments) / sharers + self._explicit[owner]

    def _moved(self) -> None:
        """Segments changed hands, or pools came or went: the shares are stale."""
        self._shares = self._explicit = None
        self._no_reclaim.clear()

    def _counts(self) -> Shares:
        """(owner share, shared pools by owner, shared segments held by owner), counted
        once after each change (`_moved`): a pool at its share asks on every page it
        stores, and the answer must not walk every pool each time."""
        if self._shares is None:
            shared = self.shared_pools()
            pools, held = Counter(p.owner for p in shared), Counter[Hashable]()
            for p in shared:
                held[p.owner] += len(p.segments)
            share = (self.n_segments - self.explicit_segments) / max(len(pools), 1)
            self._shares = (share, pools, held)
        return self._shares

    def owner_share(self) -> float:
        """Shared segments each owner of shared pools may hold before it evicts its own."""
        return self._counts()[0]

    def pool_share(self, pool: PagePool) -> float:
        """`pool`'s part of its owner's share."""
        share, pools, _ = self._counts()
        return share / max(pools[pool.owner], 1)

    def _held(self, owner: Hashable) -> int:
        return self._counts()[2][owner]

    def _grow(self, pool: PagePool) -> bool:
        """A segment for `pool`: a free one, else one reclaimed (`_reclaim_for`) while it
        may take one (no walk of the pools when it is at its share: `_may_reclaim`).
        A reclaim that found nothing is not tried again for the pool's next RECLAIM_RETRY
        grows unless a segment moves or goes idle meanwhile: each try walks the shared
        pools, and a pool below its share asks on every page it stores (it evicts its own
        pages meanwhile)."""
        if not self.free_segments and self._may_reclaim(pool) and not self._skip_reclaim(pool):
            got, kept = self._reclaim_for(pool)
            if not got and not kept:  # (pages write-back kept may go once written)
                self._no_reclaim[pool.name] = RECLAIM_RETRY
        if not self.free_segments:
            return False
        pool.add_segment(self.free_segments.pop())
        self._moved()
        return True

    def _segment_idle(self, pool: PagePool) -> None:
        """A segment of `pool` may be reclaimed now: every other pool's skip ends (not
        `pool`'s own: its own copies ending free nothing it could reclaim)."""
        if self._no_reclaim:
            mine = self._no_reclaim.get(pool.name)
            self._no_reclaim.clear()
            if mine is not None:
                self._no_reclaim[pool.name] = mine

    def _skip_reclaim(self, pool: PagePool) -> bool:
        left = self._no_reclaim.get(pool.name)
        if left is None:
            return False
        if left <= 1:
            del self._no_reclaim[pool.name]
        else:
            self._no_reclaim[pool.name] = left - 1
        return True

    def _may_reclaim(self, pool: PagePool) -> bool:
        if not pool.segments:
            return True
        share, pools, held = self._counts()
        mine = share / max(pools[pool.owner], 1)
        return (held[pool.owner] + 1 <= max(share, 1.0) and len(held) > 1) or len(
            pool.segments
        ) + 1 <= max(mine, 1.0)

    def _reclaim_for(self, pool: PagePool) -> tuple[bool, bool]:
        """One segment for `pool`, coldest idle one first; returns (one was freed, a victim
        held pages `on_evict` kept). While its owner is below the owner share, from pools
        of owners above it (the owner furthest above first, its largest pool first); while
        `pool` is below its pool share, from its owner's pools above theirs (largest first).
        A pool without any segment may always take one: from another owner's only while
        its own owner is below the owner share (else a tenant would take one segment of its
        neighbours' pages per namespace it makes, up to 256), else from its own owner's
        pools: with more namespaces than segments the share rounds below one."""
        shared = [p for p in self.shared_pools() if p is not pool and p.segments]
        held = {o: self._held(o) for o in {p.owner for p in shared} | {pool.owner}}
        first = not pool.segments
        owner_share, pool_share = self.owner_share(), (0.0 if first else self.pool_share(pool))
        victims = []
        room = max(owner_share, 1.0)  # growth stays within the share; a first segment: below it
        if (held[pool.owner] < room) if first else (held[pool.owner] + 1 <= room):
            others = [p for p in shared if p.owner != pool.owner and held[p.owner] > owner_share]
            victims += sorted(others, key=lambda p: (held[p.owner], len(p.segments)), reverse=True)
        if first or len(pool.segments) + 1 <= max(pool_share, 1.0):
            mine = [p for p in shared if p.owner == pool.owner and len(p.segments) > pool_share]
            victims += sorted(mine, key=lambda p: len(p.segments), reverse=True)
        kept = False
        for victim in victims:
            seg = victim.reclaim_segment()
            if seg is not None:
                self.free_segments.append(seg)
                self._moved()
                return True, kept
            kept = kept or victim.reclaim_kept
        return False, kept

    # -- bytes ------------------------------------------------------------------------
    def view(self, offset: int, length: int) -> memoryview:
        return self.arena.view(offset, length)

    def invariants(self) -> None:
        """Every segment is free or owned by exactly one pool; every pool is consistent."""
        owners = [0] * self.n_segments
        for s in self.free_segments:
            owners[s] += 1
        explicit = 0
        for pool in list(self.pools.values()) + self.draining:
            pool.invariants()
            for s in pool.segments:
                owners[s] += 1
            if pool.max_pages is not None and not pool.closed:
                explicit += len(pool.segments)
        if any(c != 1 for c in owners):
            bad = [i for i, c in enumerate(owners) if c != 1][:5]
            raise PoolInvariantError(f"segments {bad} are owned {[owners[i] for i in bad]} times")
        if explicit != self.explicit_segments:
            raise PoolInvariantError(f"explicit segments {self.explicit_segments} != {explicit}")
        cached, self._shares = self._shares, None
        if cached is not None and cached != self._counts():
            raise PoolInvariantError(f"cached shares {cached} are stale: {self._shares}")
