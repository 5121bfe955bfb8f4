"""A hypothesis state machine over the whole host pool: several namespaces (fair-share and
explicit) growing, reclaiming each other's segments, dropped while busy. Every committed
page holds bytes derived from its key: after every step each READY page must still hold
its own bytes (no slot shared or handed over while in use), pinned pages never vanish, and
`invariants()` holds."""

import hashlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pools import Arena, HostPool, PoolFull
from pools.page_pool import BUSY, PRESENT

SEG, PAGE = 2048, 512  # 4 pages a segment, 4 segments: the arena fills fast
NAMES = ["a", "b", "c"]


def page(name, key):
    return hashlib.shake_256(f"{name}/{key}".encode()).digest(PAGE)


class HostPoolModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.arena = Arena(4 * SEG)
        self.host = HostPool(self.arena, SEG)
        self.pins = []  # (name, pool, entry)
        self.reserved = []  # (name, pool, entry)

    @initialize()
    def two_shared_namespaces(self):
        """Start with two fair-share namespaces, so one filling the arena forces reclaims."""
        self.host.create("a", PAGE)
        self.host.create("b", PAGE)

    def teardown(self):
        self.arena.close()

    @rule(name=st.sampled_from(NAMES), explicit=st.booleans())
    def create(self, name, explicit):
        if name in self.host.pools:
            return
        try:
            self.host.create(name, PAGE, SEG if explicit else None)
        except PoolFull:
            assert explicit

    @rule(name=st.sampled_from(NAMES), key=st.integers(0, 40))
    def reserve(self, name, key):
        pool = self.host.pools.get(name)
        if pool is None:
            return
        r = pool.reserve(f"k{key}")
        if r is not None and r is not PRESENT and r is not BUSY:
            self.host.view(r.offset, PAGE)[:] = page(name, r.key)
            self.reserved.append((name, pool, r))

    @rule(name=st.sampled_from(NAMES), keys=st.lists(st.integers(0, 40), min_size=1, max_size=8))
    def store_batch(self, name, keys):
        """What a set does: reserve every key, fill, commit."""
        pool = self.host.pools.get(name)
        if pool is None:
            return
        fresh = []
        for k in keys:
            r = pool.reserve(f"k{k}")
            if r is not None and r is not PRESENT and r is not BUSY:
                self.host.view(r.offset, PAGE)[:] = page(name, r.key)
                fresh.append(r)
        for r in fresh:
            pool.commit(r)

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data, commit):
        name, pool, r = self.reserved.pop(data.draw(st.integers(0, len(self.reserved) - 1)))
        pool.commit(r) if commit else pool.abort(r)

    @rule(name=st.sampled_from(NAMES), key=st.integers(0, 40))
    def pin(self, name, key):
        pool = self.host.pools.get(name)
        e = pool.pin(f"k{key}") if pool else None
        if e is not None:
            self.pins.append((name, pool, e))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        _, pool, e = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        pool.unpin(e)

    @rule(name=st.sampled_from(NAMES))
    def drop(self, name):
        if name in self.host.pools:
            self.host.drop(name)

    @invariant()
    def pages_hold_their_own_bytes(self):
        self.host.invariants()
        for name, pool in self.host.pools.items():
            for key, e in pool.ready.items():
                assert self.host.view(e.offset, PAGE) == page(name, key), f"{name}/{key} corrupted"
        for name, _pool, e in self.pins:  # a pinned page keeps its bytes even if dropped
            assert self.host.view(e.offset, PAGE) == page(name, e.key)
        for name, _pool, r in self.reserved:
            assert self.host.view(r.offset, PAGE) == page(name, r.key)


TestHostPoolModel = HostPoolModel.TestCase
TestHostPoolModel.settings = settings(max_examples=150, stateful_step_count=80, deadline=None)
