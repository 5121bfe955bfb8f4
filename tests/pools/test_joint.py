"""The joint of several pools against the intersection of their READY keys, through every
way a key comes and goes (publish, abort, delete, eviction, a delete while being written,
close), with the build stepped in between, and detached at any time."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from pools.joint import Joint
from pools.page_pool import BUSY, PRESENT, PagePool, PoolInvariantError

KEYS = [f"k{i}" for i in range(10)]
CAPS = (4, 6, 10)  # pages per pool: the small ones evict


def pool(name: str, cap: int) -> PagePool:
    p = PagePool(name, 8, 8 * cap, max_pages=cap)
    p.add_segment(0)
    return p


def common(pools) -> set:
    return set(pools[0].ready).intersection(*(p.ready for p in pools[1:]))


def leading(keys, held) -> int:
    n = 0
    while n < len(keys) and keys[n] in held:
        n += 1
    return n


class JointModel(RuleBasedStateMachine):
    reservations = Bundle("reservations")

    def __init__(self):
        super().__init__()
        self.pools = [pool(f"p{i}", cap) for i, cap in enumerate(CAPS)]
        self.joint = None
        self.steps = None
        self.done = set()

    @rule(i=st.integers(0, 2), key=st.sampled_from(KEYS))
    def store(self, i, key):
        p = self.pools[i]
        e = p.reserve(key)
        if e is not None and e is not PRESENT and e is not BUSY:
            p.commit(e)

    @rule(target=reservations, i=st.integers(0, 2), key=st.sampled_from(KEYS))
    def reserve(self, i, key):
        e = self.pools[i].reserve(key)
        return (i, None if e in (None, PRESENT, BUSY) else e)

    @rule(r=reservations, commit=st.booleans())
    def finish(self, r, commit):
        i, e = r
        if e is None or id(e) in self.done:
            return
        self.done.add(id(e))  # the bundle keeps e alive, so its id stays its own
        (self.pools[i].commit if commit else self.pools[i].abort)(e)

    @rule(i=st.integers(0, 2), key=st.sampled_from(KEYS))
    def delete(self, i, key):
        self.pools[i].delete(key)

    @precondition(lambda self: self.joint is None)
    @rule(n=st.integers(2, 3))
    def make_joint(self, n):
        self.joint = Joint(self.pools[:n])
        self.steps = self.joint.build(2)
        next(self.steps, None)

    @precondition(lambda self: self.steps is not None)
    @rule()
    def build_step(self):
        next(self.steps, None)

    @precondition(lambda self: self.joint is not None)
    @rule()
    def detach(self):
        self.joint.detach()
        assert not any(p.joints for p in self.pools)
        self.joint = self.steps = None

    @precondition(lambda self: self.joint is not None)
    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=8))
    def prefix(self, keys):
        both = common(self.joint.pools)
        got = self.joint.prefix(keys)
        assert got <= leading(keys, both)  # never claims a key some pool lacks
        if self.joint.built:
            assert got == leading(keys, both)

    @invariant()
    def consistent(self):
        for p in self.pools:
            p.invariants()
        if self.joint is not None:
            self.joint.invariants()


TestJointModel = JointModel.TestCase
TestJointModel.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                   database=None, derandomize=True)


def test_build_runs_a_chunk_a_step_and_pages_change_between_steps():
    a, b = pool("a", 20), pool("b", 20)
    for k in KEYS:
        for p in (a, b):
            p.commit(p.reserve(k))
    joint = Joint([a, b])
    steps = joint.build(3)
    assert next(steps) == 3 and len(joint.full) == 3 and not joint.built
    a.delete(KEYS[0])      # done already: leaves
    b.delete(KEYS[5])      # not reached yet: never joins
    c = a.reserve("new")
    a.commit(c)
    b.commit(b.reserve("new"))   # both hold it: joins at once
    assert "new" in joint.full and KEYS[0] not in joint.full
    list(steps)
    assert joint.built
    assert set(joint.full) == set(KEYS[1:5] + KEYS[6:] + ["new"])
    joint.invariants()


def test_a_page_evicted_from_one_pool_leaves_the_joint():
    a, b = pool("a", 2), pool("b", 4)
    joint = Joint([a, b])
    list(joint.build(8))
    for k in KEYS[:2]:
        for p in (a, b):
            p.commit(p.reserve(k))
    assert joint.prefix(KEYS[:2]) == 2
    a.commit(a.reserve(KEYS[2]))   # a is full: evicts k0
    assert joint.prefix(KEYS[:2]) == 0 and a.evictions == 1
    joint.invariants()


def test_close_and_detach_empty_it():
    a, b = pool("a", 4), pool("b", 4)
    joint = Joint([a, b])
    for p in (a, b):
        p.commit(p.reserve("k"))
    list(joint.build(8))
    assert joint.full == {"k": None}
    a.close()
    assert joint.full == {}
    joint.detach()
    assert a.joints == b.joints == [] and joint.pools == ()
    joint.invariants()


def test_invariants_name_a_joint_that_claims_too_much_or_too_little():
    a, b = pool("a", 4), pool("b", 4)
    a.commit(a.reserve("k"))
    b.commit(b.reserve("k"))
    joint = Joint([a, b])
    list(joint.build(8))
    joint.full["other"] = None
    with pytest.raises(PoolInvariantError, match="not in every pool"):
        joint.invariants()
    joint.full.clear()
    with pytest.raises(PoolInvariantError, match="common keys missing"):
        joint.invariants()
