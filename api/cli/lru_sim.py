"""An exact offline model of one host-pool namespace of fixed capacity, request by request,
with the sidecar's semantics:

    exists  -> longest present prefix, no LRU change
    get     -> each hit key moves to the most-recent end, in order
    set     -> in order: a present key moves to the most-recent end; a new key takes a free
               slot or evicts the least recent committed page (pages reserved by this
               request are not evictable, and a key with no slot is not stored); the new
               keys join the most-recent end in order when the request commits
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class LruSim:
    """The replay's oracle: feed it each request's keys, it answers the hit prefix."""

    def __init__(self, capacity_pages: int):
        if capacity_pages < 1:
            raise ValueError("capacity must be at least one page")
        self.capacity = capacity_pages
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.evictions = 0

    def prefix(self, keys: Sequence[str]) -> int:
        n = 0
        for k in keys:
            if k not in self.lru:
                break
            n += 1
        return n

    def get(self, keys: Sequence[str]) -> None:
        for k in keys:
            if k in self.lru:
                self.lru.move_to_end(k)

    def set(self, keys: Sequence[str]) -> list[bool]:
        reserved: list[str] = []
        stored = []
        for k in keys:
            if k in self.lru:
                self.lru.move_to_end(k)
                stored.append(True)
            elif k in reserved:
                stored.append(True)
            elif len(self.lru) + len(reserved) < self.capacity:
                reserved.append(k)
                stored.append(True)
            elif self.lru:
                self.lru.popitem(last=False)
                self.evictions += 1
                reserved.append(k)
                stored.append(True)
            else:
                stored.append(False)
        for k in reserved:
            self.lru[k] = None
        return stored

    def request(self, keys: Sequence[str]) -> int:
        """exists, get of the hit prefix, set of the rest: return the hit prefix length."""
        hit = self.prefix(keys)
        self.get(keys[:hit])
        if hit < len(keys):
            self.set(keys[hit:])
        return hit
