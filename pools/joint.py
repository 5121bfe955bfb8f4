"""Which pools of a set hold each key READY: a hybrid model's KV pool and its extra pools
(indexer, Mamba state, sliding window), told for all of them in one probe a key.

    pools        kv   idx   mamba          bit 0, 1, 2 (their order in the joint)
    kv.ready     {k0 k1 k2 k3    }
    idx.ready    {k0 k1    k3    }
    mamba.ready  {   k1       k4 }
    masks        {k0: 011  k1: 111  k2: 001  k3: 011  k4: 100}    (bits: mamba idx kv)

    walk([k0 k1 k2 k3 k5], need=kv)       = 03 07 01 03    (bytes; stops at k5: no kv)
    walk([k0 k1 k3 k2], need=kv + idx)    = 03 07 03       (stops at k2: no idx)

The pools keep it current (`PagePool.joints`): a page published in a pool sets its bit,
a page that leaves clears it, and a key with no bit left leaves `masks`. Pages already
there when a joint is made join through `build`, a chunk at a time. So a bit is set only
where its pool holds the key (an answer from the joint is never wrong, only short while
building), and every such bit is set once `built`. Up to 8 pools: a mask is one byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from operator import itemgetter

from pools.page_pool import PagePool, PoolInvariantError

MAX_POOLS = 8
NONE = "\x00"  # the mask of a key no pool holds

_TABLES: dict[int, bytes] = {}  # need -> its `held_by` table


def table(need: int) -> bytes:
    """The `bytes.translate` table of `need`: 1 for each mask holding every bit of it."""
    made = _TABLES.get(need)
    if made is None:
        made = _TABLES[need] = bytes(int(m & need == need) for m in range(256))
    return made


def held_by(masks: bytes, need: int) -> bytes:
    """One byte a mask: 1 where it holds every bit of `need` (a translate in C)."""
    return masks.translate(table(need))


class Joint:
    """The READY keys of `pools` (one page size each, any sizes), as a bit mask a key."""

    __slots__ = ("pools", "masks", "built")

    def __init__(self, pools: list[PagePool]):
        assert 2 <= len(pools) <= MAX_POOLS, "a joint has two to eight pools"
        self.pools: tuple[PagePool, ...] = tuple(pools)
        self.masks: dict[str, str] = {}  # key -> chr(its mask): joined, read as bytes
        self.built = False
        for pool in self.pools:
            pool.joints.append(self)

    def bit(self, pool: PagePool) -> int:
        return 1 << self.pools.index(pool)

    def walk(self, keys: list[str], need: int) -> bytes:
        """The masks of the leading run of keys whose mask holds every bit of `need`.
        Past a first and a last probe, a few more close in on where the keys stop being
        in `masks`, and the masks up to there are read in one pass in C, which finds the
        run's end (a key lacking a bit of `need` ends it first)."""
        masks, n = self.masks, len(keys)
        if not n or ord(masks.get(keys[0], NONE)) & need != need:
            return b""
        hi = n
        if keys[-1] not in masks:
            lo, hi = 0, n - 1  # keys[lo] in masks, keys[hi] not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if keys[mid] in masks:
                    lo = mid
                else:
                    hi = mid
        try:
            found = "".join(itemgetter(*keys[:hi])(masks))
        except KeyError as miss:  # a key no pool holds: the run ends there
            hi = keys.index(miss.args[0], 0, hi)
            found = "".join(itemgetter(*keys[:hi])(masks))
        read = found.encode("latin-1")
        end = held_by(read, need).find(0)
        return read if end < 0 else read[:end]

    def added(self, pool: PagePool, key: str) -> None:
        """`pool` published `key`."""
        self.masks[key] = chr(ord(self.masks.get(key, NONE)) | self.bit(pool))

    def removed(self, pool: PagePool, key: str) -> None:
        """`pool` let `key` go (evicted or deleted)."""
        mask = ord(self.masks.get(key, NONE)) & ~self.bit(pool)
        if mask:
            self.masks[key] = chr(mask)
        else:
            self.masks.pop(key, None)

    def build(self, chunk: int) -> Iterator[int]:
        """Add the keys there before the joint, `chunk` keys a step, pool after pool (each
        pool's keys listed when its turn comes): a generator whose first step runs on the
        first `next`, and which yields (the keys done) before each later one; `built`
        when it ends. A key gone by its step is passed over."""
        done, room = 0, chunk
        for pool in self.pools:
            keys, lo = list(pool.ready), 0
            while lo < len(keys):
                if not room:
                    yield done
                    if not self.pools:  # detached meanwhile
                        return
                    room = chunk
                part = keys[lo : lo + room]
                for key in part:
                    if key in pool.ready:
                        self.added(pool, key)
                lo, done, room = lo + len(part), done + len(part), room - len(part)
        self.built = True

    def detach(self) -> None:
        """Stop following the pools (one of them is going away)."""
        for pool in self.pools:
            pool.joints.remove(self)
        self.pools, self.built = (), False
        self.masks.clear()

    def invariants(self) -> None:
        """Each bit set only where its pool holds the key, no empty mask, and every held
        key's bit set once built; raise PoolInvariantError on the first broken rule."""
        try:
            self._invariants()
        except AssertionError as exc:
            raise PoolInvariantError(f"joint of {[p.name for p in self.pools]}: {exc}") from exc

    def _invariants(self) -> None:
        if not self.pools:
            assert not self.masks, "a detached joint holds keys"
            return
        for key, char in self.masks.items():
            mask = ord(char)
            assert 0 < mask < 1 << len(self.pools), f"mask {mask} of {key!r}"
            for i, pool in enumerate(self.pools):
                assert not mask >> i & 1 or key in pool.ready, f"{key!r} not in {pool.name}"
        if self.built:
            for i, pool in enumerate(self.pools):
                missing = [k for k in pool.ready if not ord(self.masks.get(k, NONE)) >> i & 1]
                assert not missing, f"keys of {pool.name} missing: {missing[:5]}"
        assert all(self in p.joints for p in self.pools), "a pool does not report to its joint"
