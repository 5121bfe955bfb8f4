"""The keys every pool of a set holds READY: a hybrid model's KV pool and the pools that
keep a page for every KV page (DeepSeek's indexer), looked up in one probe a key for all.

    kv.ready    {k0 k1 k2 k3    k5}
    idx.ready   {k0 k1    k3 k4 k5}
    joint.full  {k0 k1    k3    k5}       prefix([k0 k1 k3 k5 k4]) = 4
                                          prefix([k0 k1 k2 k3])    = 2

The pools keep it current (`PagePool.joints`): a page published in one pool joins `full`
when every other pool of the joint holds it; a page that leaves any pool leaves `full`.
Pages already there when a joint is made join it through `build`, a chunk at a time. So
`full` is always a subset of the pools' common keys (an answer from it is never wrong,
only short while building), and equal to it once `built`.
"""
from __future__ import annotations

from typing import Iterator

from pools.page_pool import PagePool, PoolInvariantError, run_length


class Joint:
    """The common READY keys of `pools` (one pool page size each, any sizes)."""

    __slots__ = ("pools", "full", "built")

    def __init__(self, pools: list[PagePool]):
        assert len(pools) >= 2, "a joint of fewer than two pools is the pool itself"
        self.pools: tuple[PagePool, ...] = tuple(pools)
        self.full: dict[str, None] = {}
        self.built = False
        for pool in self.pools:
            pool.joints.append(self)

    def prefix(self, keys: list[str]) -> int:
        """Length of the leading run of keys that every pool holds READY."""
        return run_length(self.full, keys)

    def added(self, key: str) -> None:
        """A pool published `key`: it joins when every pool holds it now."""
        for pool in self.pools:
            if key not in pool.ready:
                return
        self.full[key] = None

    def removed(self, key: str) -> None:
        """A pool let `key` go (evicted or deleted)."""
        self.full.pop(key, None)

    def build(self, chunk: int) -> Iterator[int]:
        """Add the common keys there before the joint, `chunk` keys of the smallest pool a
        step: a generator whose first step runs on the first `next`, and which yields (the
        keys done) before each later one; `built` when it ends."""
        smallest = min(self.pools, key=lambda p: len(p.ready))
        keys = list(smallest.ready)
        for lo in range(0, len(keys), chunk):
            if lo:
                yield lo
            if not self.pools:  # detached meanwhile
                return
            for key in keys[lo:lo + chunk]:
                self.added(key)
        self.built = True

    def detach(self) -> None:
        """Stop following the pools (one of them is going away)."""
        for pool in self.pools:
            pool.joints.remove(self)
        self.pools, self.built = (), False
        self.full.clear()

    def invariants(self) -> None:
        """`full` holds only common keys, and every one of them once built; raise
        PoolInvariantError on the first broken rule."""
        try:
            self._invariants()
        except AssertionError as exc:
            raise PoolInvariantError(f"joint of {[p.name for p in self.pools]}: {exc}") from exc

    def _invariants(self) -> None:
        if not self.pools:
            assert not self.full, "a detached joint holds keys"
            return
        common = set(self.pools[0].ready).intersection(*(p.ready for p in self.pools[1:]))
        assert common.issuperset(self.full), f"keys not in every pool: {set(self.full) - common}"
        if self.built:
            assert len(common) == len(self.full), f"common keys missing: {common - set(self.full)}"
        assert all(self in p.joints for p in self.pools), "a pool does not report to its joint"
