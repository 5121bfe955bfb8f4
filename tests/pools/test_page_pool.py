"""PagePool: the reserve/commit/abort protocol, pins, LRU eviction order, doomed deletes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pools.lru import LruList
from pools.page_pool import (
    BUSY,
    EVICT_SCAN,
    PRESENT,
    READY,
    RESERVED,
    PagePool,
    PoolInvariantError,
    run_in_any,
)


def make(pages=4, page=16):
    pool = PagePool("t", page, page * pages, max_pages=pages)
    pool.add_segment(0)
    return pool


def put(pool, key):
    e = pool.reserve(key)
    assert e is not None and e is not PRESENT
    assert pool.commit(e)
    pool.invariants()
    return e


def test_reserved_is_invisible_until_commit():
    pool = make()
    e = pool.reserve("a")
    assert e.state == RESERVED
    assert not pool.contains("a") and pool.prefix(["a"]) == 0 and pool.pin("a") is None
    assert pool.reserve("a") is BUSY  # a second writer neither copies again nor claims it stored
    pool.invariants()
    pool.commit(e)
    assert e.state == READY and pool.contains("a") and pool.prefix(["a", "b"]) == 1
    pool.invariants()


@pytest.mark.parametrize(
    "keys, n",
    [
        ([], 0),
        (["a"], 1),
        (["x"], 0),
        (["a", "b", "c"], 3),  # the last key present: one look-up of them all
        (["a", "x", "c"], 1),  # ... a miss inside it ends the run at its place
        (["a", "b", "x", "a", "x", "c"], 2),  # a missing key seen twice: its first place
        (["a", "b", "c", "x"], 3),  # the last key missing: the walk
        (["r", "a"], 0),  # reserved is not present, on either path
    ],
)
def test_prefix_on_both_paths(keys, n):
    pool = make()
    for k in "abc":
        put(pool, k)
    pool.reserve("r")
    assert pool.prefix(keys) == n
    pool.invariants()


def test_abort_frees_the_slot_and_hides_the_key():
    pool = make(pages=1)
    e = pool.reserve("a")
    pool.abort(e)
    pool.invariants()
    assert not pool.contains("a") and len(pool.free) == 1
    put(pool, "b")


def test_lru_eviction_order_and_touch():
    pool = make(pages=3)
    for k in "abc":
        put(pool, k)
    assert pool.pin("a") is not None  # touch a: b is now least recent
    pool.unpin(pool.entries["a"])
    put(pool, "d")
    assert pool.present(list("abcd")) == [True, False, True, True]
    assert pool.evictions == 1
    assert pool.reserve("c") is PRESENT  # a set of a present key touches it too
    put(pool, "e")
    assert pool.present(list("acde")) == [False, True, True, True]
    pool.invariants()


def test_pinned_pages_are_not_evicted_and_full_pool_says_none():
    pool = make(pages=2)
    a, b = put(pool, "a"), put(pool, "b")
    pool.pin("a"), pool.pin("b")
    assert pool.reserve("c") is None
    pool.unpin(a)
    c = pool.reserve("c")
    assert c is not None and c.offset == a.offset
    pool.commit(c)
    pool.unpin(b)
    pool.invariants()


class CountingLru(LruList):
    """The pool's LRU list, counting the nodes eviction walks."""

    __slots__ = ("walked",)

    def __init__(self):
        super().__init__()
        self.walked = 0

    def from_lru(self):
        for node in super().from_lru():
            self.walked += 1
            yield node


def test_eviction_never_walks_past_pinned_pages():
    """Pinned pages are off the LRU list: with the 63 oldest of 64 pages pinned (copies, or
    writes to a slow tier) a reserve looks at one page, not 64; with all 64 pinned it
    answers "no room" having looked at none (a set of 4,096 keys walked a 65,536-page
    pool once per key before: 11 s on the event loop)."""
    pool = make(pages=64)
    pool.lru = CountingLru()
    for i in range(64):
        put(pool, f"k{i}")
    for i in range(63):
        pool.pin(f"k{i}")
    assert len(pool.lru) == 1 and pool.ready_pages == 64
    pool.lru.walked = 0
    r = pool.reserve("new")
    assert r is not None and not pool.contains("k63") and pool.lru.walked == 1
    pool.commit(r)
    pool.pin("new")
    pool.lru.walked = 0
    assert pool.reserve("more") is None and pool.lru.walked == 0
    pool.invariants()


def test_eviction_passes_over_at_most_evict_scan_kept_pages():
    """Write-back with a full queue keeps every unwritten page (`on_evict` False): one
    eviction looks at EVICT_SCAN of them at most, then answers no room (the set waits for
    the writer); a written page within them is taken."""
    n = EVICT_SCAN * 2
    pool = make(pages=n)
    pool.lru = CountingLru()
    for i in range(n):
        put(pool, f"k{i}")
    written = set()
    pool.on_evict = lambda p, e: e.key in written
    assert pool.reserve("x") is None and pool.lru.walked == EVICT_SCAN
    written.add(f"k{EVICT_SCAN - 1}")
    r = pool.reserve("x")
    assert r is not None and not pool.contains(f"k{EVICT_SCAN - 1}")
    pool.commit(r)
    written.add(f"k{n - 1}")  # past the scan: kept, the caller waits
    assert pool.reserve("y") is None and pool.contains(f"k{n - 1}")
    pool.invariants()


def test_the_last_unpin_makes_a_page_the_newest():
    pool = make(pages=3)
    for k in "abc":
        put(pool, k)
    a = pool.pin("a")
    pool.pin("a")
    put(pool, "d")  # a is pinned: b goes
    assert pool.present(list("abcd")) == [True, False, True, True]
    pool.unpin(a)
    assert [e.key for e in pool.lru.from_lru()] == ["c", "d"]  # still pinned once
    pool.unpin(a)
    assert [e.key for e in pool.lru.from_lru()] == ["c", "d", "a"]
    assert pool.reserve("a") is PRESENT and pool.peek(["c"])[0] is not None  # touch: d, a, c
    put(pool, "e")
    assert pool.present(list("acde")) == [True, True, False, True]
    pool.invariants()


def test_reserved_pages_are_not_evicted():
    pool = make(pages=1)
    r = pool.reserve("a")
    assert pool.reserve("b") is None
    pool.commit(r)
    pool.invariants()


def test_delete_of_pinned_page_defers_the_slot():
    pool = make(pages=1)
    put(pool, "a")
    e = pool.pin("a")
    assert pool.delete("a") is True
    assert not pool.contains("a") and pool.reserve("b") is None  # slot still held
    pool.invariants()
    pool.unpin(e)
    pool.invariants()
    put(pool, "b")


def test_delete_of_reserved_page_wins_over_commit():
    pool = make(pages=1)
    r = pool.reserve("a")
    assert pool.delete("a") is False
    assert pool.commit(r) is False
    assert not pool.contains("a") and len(pool.free) == 1
    pool.invariants()


def test_broken_counts_raise_not_clamp():
    pool = make()
    e = put(pool, "a")
    with pytest.raises(PoolInvariantError):
        pool.unpin(e)
    with pytest.raises(PoolInvariantError):
        pool.commit(e)
    pool.entries["a"].pins = 1  # corrupt a count behind the pool's back
    with pytest.raises(PoolInvariantError):
        pool.invariants()


def test_slot_offsets_are_page_aligned_and_distinct():
    pool = make(pages=4, page=24)
    offsets = sorted(put(pool, k).offset for k in "abcd")
    assert offsets == [0, 24, 48, 72]


def test_reclaim_segment_evicts_its_pages_and_skips_busy_ones():
    pool = PagePool("t", 16, 32)  # 2 slots a segment, grows without limit
    pool.add_segment(0)
    pool.add_segment(1)
    for k in "abcd":
        put(pool, k)
    busy = pool.pin("a").offset // 32  # a's segment is busy
    other = [k for k in "bcd" if pool.entries[k].offset // 32 != busy]
    seg = pool.reclaim_segment()
    assert seg == 1 - busy
    assert pool.present(list("abcd")) == [k not in other for k in "abcd"]
    assert pool.capacity_pages == 2
    pool.invariants()
    assert pool.reclaim_segment() is None  # the only segment left has a pinned page


def _segmented(segments=8, per=16):
    """A pool of `segments` segments of `per` 16-byte pages, full, its LRU list counting."""
    pool = PagePool("t", 16, 16 * per)
    pool.lru = CountingLru()
    for s in range(segments):
        pool.add_segment(s)
    for i in range(segments * per):
        put(pool, f"k{i}")
    return pool


def test_reclaim_walks_no_page_but_the_segment_it_empties():
    """Busy slots are counted per segment: a reclaim in a pool whose segments are all busy
    answers None having looked at EVICT_SCAN pages at most (it walked every page, then
    every page again per segment: seconds on the loop at a million pages), and one that
    finds an idle segment evicts that segment's pages only."""
    pool = _segmented()
    pins = [pool.pin(f"k{i * 16}") for i in range(8)]  # one page of each segment
    pool.lru.walked = 0
    evicted = pool.evictions
    assert pool.idle_segments() == 0 and pool.reclaim_segment() is None
    assert pool.lru.walked <= EVICT_SCAN and pool.evictions == evicted
    pool.unpin(pins[5])
    assert pool.idle_segments() == 1
    pool.lru.walked = 0
    seg = pool.reclaim_segment()
    assert seg == pins[5].offset // pool.segment_size
    assert pool.evictions == evicted + 16 and pool.lru.walked <= EVICT_SCAN
    assert len(pool.segments) == 7 and pool.ready_pages == 7 * 16
    pool.invariants()


def test_close_walks_only_the_busy_pages(monkeypatch):
    """With no joint or log to tell, close() dooms the busy entries and lets the rest go
    with the index: no delete of each key (676 ms for 917,504 pages before, 38 ms now)."""
    pool = _segmented(segments=2)
    pinned, res = pool.pin("k3"), pool.reserve("new")  # a copy out, a copy in
    assert res is not None and res is not PRESENT
    idle = []
    pool.on_idle = idle.append
    deletes = []
    monkeypatch.setattr(pool, "delete", lambda key: deletes.append(key))
    ready = pool.ready  # what a look-up across an await holds
    pool.close()
    assert not ready
    assert not deletes and not pool.entries and not pool.ready and len(pool.lru) == 0
    assert pinned.doomed and res.doomed and pool.busy == 2 and not idle
    pool.invariants()
    pool.unpin(pinned)
    assert pool.commit(res) is False and pool.busy == 0 and idle == [pool]
    pool.invariants()


def test_page_larger_than_segment_is_refused():
    with pytest.raises(ValueError):
        PagePool("t", 64, 32)


def test_a_segment_of_small_slots_costs_no_memory_until_its_slots_are_used():
    """Issue 26, item 7: a pool of tiny pages kept one Python int per slot from the moment
    a segment came (page_bytes=1: one int per pool byte, a 5 s stall and 1.3 GB for one
    PUT). Now what a segment adds is the same whatever its slot count."""
    import tracemalloc

    def cost(page_bytes: int) -> int:
        pool = PagePool("p", page_bytes, 1 << 20)
        tracemalloc.start()
        pool.add_segment(0)
        used = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert pool.capacity_pages == (1 << 20) // page_bytes == pool.free_slots
        return used

    assert cost(512) < 1024 and abs(cost(512) - cost(1 << 20)) < 256
    pool = PagePool("p", 512, 1 << 20)
    pool.add_segment(0)
    entries = [pool.reserve(f"k{i}") for i in range(3)]
    assert [e.offset for e in entries] == [0, 512, 1024]  # address order, as before
    pool.abort(entries[1])
    assert pool.reserve("again").offset == 512  # a slot given back is reused first
    assert len(pool.free) == 0 and pool.free_slots == 2048 - 3
    pool.invariants()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=300), st.integers(1, 3))
def test_run_in_any_is_the_walk_key_by_key(where, n_indexes):
    """`run_in_any` (the host pool and the file tiers' indexes, read in C by chunks)
    against the walk it replaces: key i is in index where[i] - 1 (0: in none)."""
    keys = [f"k{i}" for i in range(len(where))]
    indexes = [
        {k: 0 for k, w in zip(keys, where, strict=True) if w == j + 1} for j in range(n_indexes)
    ]
    walked = 0
    for k in keys:
        if not any(k in ix for ix in indexes):
            break
        walked += 1
    assert run_in_any(keys, indexes) == walked
