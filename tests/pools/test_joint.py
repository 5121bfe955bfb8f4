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


def common_run(joint, keys) -> int:
    """The leading run of keys every pool of `joint` holds, as the joint walks it."""
    return len(joint.walk(keys, (1 << len(joint.pools)) - 1))


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
        got = common_run(self.joint, keys)
        assert got <= leading(keys, both)  # never claims a key some pool lacks
        if self.joint.built:
            assert got == leading(keys, both)

    @precondition(lambda self: self.joint is not None)
    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=8), need=st.integers(1, 7))
    def walk(self, keys, need):
        pools = self.joint.pools
        need &= (1 << len(pools)) - 1
        truth = [sum(1 << i for i, p in enumerate(pools) if k in p.ready) for k in keys]
        run = leading(
            list(range(len(keys))), {i for i, t in enumerate(truth) if need and t & need == need}
        )
        got = self.joint.walk(keys, need) if need else b""
        assert len(got) <= run and all(
            g & ~t == 0
            for g, t in zip(got, truth, strict=False)  # got stops at its run
        )  # never claims
        if self.joint.built:
            assert list(got) == truth[:run]

    @invariant()
    def consistent(self):
        for p in self.pools:
            p.invariants()
        if self.joint is not None:
            self.joint.invariants()


TestJointModel = JointModel.TestCase
TestJointModel.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, database=None, derandomize=True
)


def every(joint) -> set:
    """The keys whose mask has every pool's bit."""
    return {k for k, m in joint.masks.items() if ord(m) == (1 << len(joint.pools)) - 1}


def test_build_runs_a_chunk_a_step_and_pages_change_between_steps():
    a, b = pool("a", 20), pool("b", 20)
    for k in KEYS:
        for p in (a, b):
            p.commit(p.reserve(k))
    joint = Joint([a, b])
    steps = joint.build(3)
    assert next(steps) == 3 and set(joint.masks) == set(KEYS[:3]) and not joint.built
    assert every(joint) == set()  # b's turn has not come
    a.delete(KEYS[0])  # done already: a's bit leaves
    a.delete(KEYS[4])  # listed, not reached yet: a's bit never set
    b.delete(KEYS[5])  # b's keys not listed yet: b's bit never set
    c = a.reserve("new")
    a.commit(c)
    b.commit(b.reserve("new"))  # both hold it: both bits at once
    assert "new" in every(joint) and KEYS[0] not in joint.masks
    assert joint.walk(["new"], 0b11) == b"\x03"
    list(steps)
    assert joint.built
    assert every(joint) == set(KEYS[1:4] + KEYS[6:] + ["new"])
    assert [ord(joint.masks[KEYS[i]]) for i in (0, 4, 5)] == [0b10, 0b10, 0b01]
    joint.invariants()


def test_a_page_evicted_from_one_pool_leaves_the_joint():
    a, b = pool("a", 2), pool("b", 4)
    joint = Joint([a, b])
    list(joint.build(8))
    for k in KEYS[:2]:
        for p in (a, b):
            p.commit(p.reserve(k))
    assert common_run(joint, KEYS[:2]) == 2
    a.commit(a.reserve(KEYS[2]))  # a is full: evicts k0
    assert common_run(joint, KEYS[:2]) == 0 and a.evictions == 1
    assert joint.walk(KEYS[:3], joint.bit(b)) == b"\x02\x03"  # b holds k0, k1; a only k1
    joint.invariants()


def test_a_walk_reads_each_pools_pages_and_stops_where_the_asked_pool_does():
    """The masks of the run the asked pool holds, in one pass past a few probes, whatever
    where the run ends (first key, last key, in between, a key no pool holds, a key only
    another pool holds)."""
    a, b = pool("a", 10), pool("b", 10)
    joint = Joint([a, b])
    list(joint.build(8))
    for k in KEYS[:6]:
        a.commit(a.reserve(k))
    for k in KEYS[2:4] + KEYS[7:9]:
        b.commit(b.reserve(k))
    bit_a, bit_b = joint.bit(a), joint.bit(b)
    assert joint.walk(KEYS, bit_a) == bytes([1, 1, 3, 3, 1, 1])
    assert joint.walk(KEYS[:6], bit_a) == bytes([1, 1, 3, 3, 1, 1])  # the whole list
    assert joint.walk(KEYS[6:], bit_a) == b""  # not the first key
    assert joint.walk(KEYS[:3] + ["none"] + KEYS[3:6], bit_a) == bytes([1, 1, 3])
    assert joint.walk(KEYS[:2] + KEYS[7:8] + KEYS[2:6], bit_a) == bytes([1, 1])  # b's only
    assert joint.walk(KEYS[2:4] + KEYS[:2], bit_b) == bytes([3, 3])
    assert (
        joint.walk(KEYS[2:4], bit_a | bit_b) == bytes([3, 3]) and common_run(joint, KEYS[2:]) == 2
    )
    joint.invariants()


def test_close_and_detach_empty_it():
    a, b = pool("a", 4), pool("b", 4)
    joint = Joint([a, b])
    for p in (a, b):
        p.commit(p.reserve("k"))
    list(joint.build(8))
    assert joint.masks == {"k": "\x03"}
    a.close()
    assert joint.masks == {"k": "\x02"}
    b.close()
    assert joint.masks == {}
    joint.detach()
    assert a.joints == b.joints == [] and joint.pools == ()
    joint.invariants()


def test_invariants_name_a_joint_that_claims_too_much_or_too_little():
    a, b = pool("a", 4), pool("b", 4)
    a.commit(a.reserve("k"))
    b.commit(b.reserve("k"))
    joint = Joint([a, b])
    list(joint.build(8))
    joint.masks["other"] = "\x01"
    with pytest.raises(PoolInvariantError, match="'other' not in a"):
        joint.invariants()
    joint.masks["other"] = "\x00"
    with pytest.raises(PoolInvariantError, match="mask 0"):
        joint.invariants()
    del joint.masks["other"]
    joint.masks["k"] = "\x01"
    with pytest.raises(PoolInvariantError, match="keys of b missing"):
        joint.invariants()
