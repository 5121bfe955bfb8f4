"""The host pool: one arena cut into equal segments, lent to namespaces' page pools.

    arena: | seg 0: ns A | seg 1: ns B | seg 2: free | seg 3: ns A | ... |

A namespace created with an explicit capacity gets all its segments at once and never
more (its LRU is exact at that many pages). The others share the remaining segments
and grow on demand: from the free list, else, while below their fair share (the
shared segments divided by the number of shared namespaces), by reclaiming the coldest
idle segment of the namespace furthest above its share; past that they evict their own
least recent page. A namespace holding no segment may always take one from the largest
holder, so the N+1th namespace stores even when N namespaces hold every segment.
"""
from __future__ import annotations

import math
from typing import Optional

from pools.arena import Arena
from pools.page_pool import PagePool, PoolInvariantError


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

    # -- namespaces -------------------------------------------------------------------
    def create(self, name: str, page_bytes: int, capacity_bytes: Optional[int] = None) -> PagePool:
        """A page pool for `name`: a fixed share of `capacity_bytes`, or a fair share."""
        if name in self.pools:
            raise ValueError(f"pool {name!r} exists")
        if page_bytes <= 0 or page_bytes > self.segment_size:
            raise ValueError(f"page_bytes {page_bytes} is larger than the segment size "
                             f"{self.segment_size}; start with a larger --segment-size")
        if capacity_bytes is None:
            pool = PagePool(name, page_bytes, self.segment_size, grow=self._grow)
        else:
            pool = self._create_explicit(name, page_bytes, capacity_bytes)
        pool.on_idle = self._release
        self.pools[name] = pool
        return pool

    def _create_explicit(self, name: str, page_bytes: int, capacity_bytes: int) -> PagePool:
        pages = capacity_bytes // page_bytes
        if pages < 1:
            raise ValueError(f"capacity {capacity_bytes} holds no page of {page_bytes} bytes")
        pool = PagePool(name, page_bytes, self.segment_size, max_pages=pages)
        need = math.ceil(pages / pool.slots_per_segment)
        idle = sum(p.idle_segments() for p in self.shared_pools())
        if len(self.free_segments) + idle < need:  # fail before evicting anything
            raise PoolFull(f"{need} segments needed for {capacity_bytes} bytes, "
                           f"{len(self.free_segments)} free and {idle} reclaimable")
        while len(self.free_segments) < need:
            if not self._reclaim_any():  # write-back kept pages it could not queue yet
                raise PoolFull(f"{need} segments needed for {capacity_bytes} bytes; shared "
                               f"namespaces hold pages not yet written back: retry")
        for _ in range(need):
            pool.add_segment(self.free_segments.pop())
        self.explicit_segments += need
        return pool

    def drop(self, name: str) -> None:
        """Remove a pool; its segments return once no copy holds one of its slots."""
        pool = self.pools.pop(name)
        if pool.max_pages is not None:
            self.explicit_segments -= len(pool.segments)
        self.draining.append(pool)
        pool.close()

    def _release(self, pool: PagePool) -> None:
        if pool in self.draining:
            self.draining.remove(pool)
            self.free_segments.extend(pool.segments)
            pool.segments.clear()
            pool.free.clear()

    # -- growth -----------------------------------------------------------------------
    def shared_pools(self) -> list[PagePool]:
        return [p for p in self.pools.values() if p.max_pages is None]

    def fair_share(self) -> float:
        """Segments each shared pool may hold before it must evict its own pages."""
        shared = len(self.shared_pools())
        return (self.n_segments - self.explicit_segments) / max(shared, 1)

    def _grow(self, pool: PagePool) -> bool:
        """A segment for `pool`: a free one, else one reclaimed while `pool` is below its
        fair share. A pool without any segment may always reclaim one, from the largest
        holder: with more namespaces than segments the share rounds below one."""
        if not self.free_segments:
            share = self.fair_share() if pool.segments else 0.0
            if len(pool.segments) + 1 <= max(share, 1.0):
                self._reclaim_above_share(exclude=pool, share=share)
        if not self.free_segments:
            return False
        pool.add_segment(self.free_segments.pop())
        return True

    def _reclaim_above_share(self, exclude: PagePool, share: float) -> bool:
        over = [p for p in self.shared_pools() if p is not exclude and len(p.segments) > share]
        over.sort(key=lambda p: len(p.segments), reverse=True)
        for victim in over:
            seg = victim.reclaim_segment()
            if seg is not None:
                self.free_segments.append(seg)
                return True
        return False

    def _reclaim_any(self) -> bool:
        """For an explicit share: shared pools give back idle segments, largest first."""
        for victim in sorted(self.shared_pools(), key=lambda p: len(p.segments), reverse=True):
            seg = victim.reclaim_segment()
            if seg is not None:
                self.free_segments.append(seg)
                return True
        return False

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
