"""HostPool: the arena, explicit shares, fair-share growth and reclaim, draining drops."""

import os

import pytest

from pools import Arena, HostPool, PoolFull
from pools.page_pool import PRESENT

SEG = 64 * 1024


@pytest.fixture
def host():
    arena = Arena(16 * SEG)
    yield HostPool(arena, SEG)
    arena.close()


def fill(pool, prefix, n):
    for i in range(n):
        e = pool.reserve(f"{prefix}{i}")
        if e is None:
            return i
        assert e is not PRESENT
        pool.commit(e)
    return n


def test_arena_is_shared_memory_visible_through_proc_fd(host):
    view = host.view(SEG, 4)
    view[:] = b"abcd"
    path = f"/proc/{os.getpid()}/fd/{host.arena.fd}"
    with open(path, "rb") as f:
        f.seek(SEG)
        assert f.read(4) == b"abcd"  # another process mapping the memfd sees the bytes
    assert os.readlink(path).startswith("/memfd:")
    with pytest.raises(ValueError):
        host.view(16 * SEG - 2, 4)


def test_explicit_share_is_exact_and_reserved(host):
    pool = host.create("x", 4096, capacity_bytes=20 * 4096)  # 20 pages: 2 segments
    assert pool.capacity_pages == 20 and len(pool.segments) == 2
    assert fill(pool, "k", 25) == 25  # LRU keeps the last 20
    assert pool.ready_pages == 20 and pool.evictions == 5
    assert host.explicit_segments == 2
    host.invariants()


def test_explicit_share_larger_than_free_raises(host):
    with pytest.raises(PoolFull):
        host.create("x", 4096, capacity_bytes=17 * SEG)
    with pytest.raises(ValueError):
        host.create("y", 4096, capacity_bytes=100)  # holds no page
    with pytest.raises(ValueError):
        host.create("z", 2 * SEG)  # page bigger than a segment


def test_shared_pools_grow_then_split_fairly(host):
    a = host.create("a", 4096)
    fill(a, "a", 16 * 16)  # a alone takes the whole arena
    assert len(a.segments) == 16 and not host.free_segments
    b = host.create("b", 4096)
    fill(b, "b", 16 * 16)  # b reclaims a's coldest segments up to its fair share
    assert len(a.segments) == 8 and len(b.segments) == 8
    assert a.present(["a0", f"a{255}"]) == [False, True]  # the coldest pages of a went
    host.invariants()


def test_reclaim_skips_pinned_segments(host):
    a = host.create("a", 4096)
    fill(a, "a", 16 * 16)
    for k in list(a.entries):
        a.pin(k)
    b = host.create("b", 4096)
    assert b.reserve("b0") is None  # nothing of a can be reclaimed and b has nothing
    host.invariants()


def test_a_reclaim_that_found_nothing_waits_for_a_segment_to_go_idle(host, monkeypatch):
    """b is below its share, every segment of a holds a pinned page: b's grows stop trying
    to reclaim (each try walks the shared pools) and b evicts its own pages, until one of
    a's segments goes idle; then b's next page takes that segment."""
    a = host.create("a", 4096, owner=1)
    fill(a, "a", 16 * 16)
    pins = {}
    for k, e in list(a.entries.items()):
        if e.offset // SEG not in pins:  # one page of each segment
            pins[e.offset // SEG] = a.pin(k)
    b = host.create("b", 4096, owner=2)
    tries = []
    real = host._reclaim_for
    monkeypatch.setattr(host, "_reclaim_for", lambda p: tries.append(p.name) or real(p))
    assert b.reserve("b0") is None and tries == ["b"]  # nothing of a can be reclaimed
    for i in range(1, 40):
        assert b.reserve(f"b{i}") is None
    assert tries == ["b"]  # not tried again
    a.unpin(pins[3])  # a's segment 3 goes idle
    r = b.reserve("b40")
    assert r is not None and r.offset // SEG == 3 and tries == ["b", "b"]
    b.commit(r)
    # b's own commits free nothing it could reclaim: its skip goes on through them
    for i in range(41, 80):
        r = b.reserve(f"b{i}")  # one segment of 16 pages: b evicts its own
        assert r is not None
        b.commit(r)
    assert tries == ["b", "b", "b"]
    host.invariants()


def test_refused_explicit_share_evicts_nothing(host):
    a = host.create("a", 4096)
    fill(a, "a", 16 * 16)
    with pytest.raises(PoolFull):
        host.create("x", 4096, capacity_bytes=17 * SEG)
    assert a.ready_pages == 256 and len(a.segments) == 16
    host.invariants()


def test_explicit_share_takes_idle_segments_from_shared_pools(host):
    a = host.create("a", 4096)
    fill(a, "a", 16 * 16)
    x = host.create("x", 4096, capacity_bytes=4 * SEG)
    assert len(x.segments) == 4 and len(a.segments) == 12
    host.invariants()


def test_drop_with_pinned_page_returns_segments_after_unpin(host):
    a = host.create("a", 4096)
    fill(a, "a", 3)
    e = a.pin("a1")
    host.drop("a")
    assert len(host.free_segments) == 15  # a's segment is held by the pin
    host.invariants()
    a.unpin(e)
    assert len(host.free_segments) == 16
    host.invariants()


def test_more_namespaces_than_segments_each_still_store(host):
    pools = [host.create(f"n{i}", 4096) for i in range(16)]
    for p in pools:
        assert fill(p, p.name, 1) == 1
    assert not host.free_segments  # 16 namespaces hold every segment
    late = host.create("late", 4096)  # fair share 16/17 rounds below one segment
    assert fill(late, "late", 1) == 1 and len(late.segments) == 1
    assert sum(len(p.segments) for p in pools) == 15
    host.invariants()
    again = host.create("later", 4096)  # and the next one, from the largest holder
    assert fill(again, "x", 3) == 3
    host.invariants()


def test_fair_share_leaves_out_explicit_segments(host):
    """(segments - explicit ones) / shared pools: found by mutmut (the explicit segments
    added instead of taken away went unnoticed)."""
    host.create("x", SEG, capacity_bytes=4 * SEG)  # 4 explicit segments
    for name in "abc":
        host.create(name, SEG)
    assert host.fair_share() == (16 - 4) / 3
    host.drop("x")
    assert host.fair_share() == 16 / 3


def test_explicit_share_reclaims_from_the_largest_shared_pool(host):
    """An explicit share takes idle segments from the largest shared pool first (mutmut:
    the order and the size key were unguarded)."""
    small, big = host.create("small", SEG), host.create("big", SEG)
    assert fill(small, "s", 3) == 3 and fill(big, "b", 13) == 13  # 3 + 13 = all 16
    assert not host.free_segments
    host.create("x", SEG, capacity_bytes=2 * SEG)
    assert (len(small.segments), len(big.segments)) == (3, 11)
    host.invariants()


def test_growth_reclaims_only_above_the_fair_share(host):
    """A pool below its fair share takes a segment from one above it, never from itself
    or from a pool at or below the share."""
    a, b = host.create("a", SEG), host.create("b", SEG)
    assert fill(a, "a", 12) == 12 and fill(b, "b", 4) == 4  # share 8: a is over
    assert fill(b, "c", 1) == 1
    assert (len(a.segments), len(b.segments)) == (11, 5)
    c = host.create("c", SEG)  # share 16/3 = 5.3
    assert fill(c, "c", 1) == 1
    assert (len(a.segments), len(b.segments), len(c.segments)) == (10, 5, 1)
    host.invariants()


def test_segment_size_and_explicit_capacity_bounds():
    """Edges mutmut found unguarded: a segment of 1 byte up to the whole arena is allowed,
    0 or more than the arena is not; an explicit share of exactly one page is allowed."""
    arena = Arena(4 * SEG)
    try:
        for bad in (0, -1, 4 * SEG + 1):
            with pytest.raises(ValueError, match="segment size"):
                HostPool(arena, bad)
        assert HostPool(arena, 4 * SEG).n_segments == 1 and HostPool(arena, 1).n_segments == 4 * SEG
        host = HostPool(arena, SEG)
        assert host.create("one", 4096, capacity_bytes=4096).capacity_pages == 1
        with pytest.raises(ValueError, match="holds no page"):
            host.create("none", 4096, capacity_bytes=4095)
    finally:
        arena.close()


# -- owners (issue 26, item 10): one tenant cannot take the others' share -----------------
def test_an_owner_with_many_pools_gets_one_owners_share(host):
    mine = [host.create(f"a{i}", SEG, owner=1) for i in range(4)]
    for p in mine:
        fill(p, p.name, 16)  # owner 1 alone takes every segment
    assert not host.free_segments
    b = host.create("b", SEG, owner=2)
    assert fill(b, "b", 16) == 16
    assert len(b.segments) == 8  # half: one owner's share, not one pool's (1/5)
    assert sum(len(p.segments) for p in mine) == 8
    host.invariants()


def test_new_namespaces_of_a_tenant_at_its_share_take_its_own_segments(host):
    """A pool with no segment may always take one, but from its own owner's pools once the
    owner holds its share: a tenant making namespaces one after another does not evict a
    segment of its neighbour's pages for each (it could make 256)."""
    a = host.create("a", SEG, owner=1)
    fill(a, "a", 16)
    b = host.create("b", SEG, owner=2)
    assert fill(b, "b", 16) == 16 and len(b.segments) == 8 and len(a.segments) == 8
    kept = sorted(b.ready)
    for i in range(6):
        extra = host.create(f"a{i}", SEG, owner=1)
        assert fill(extra, f"x{i}", 1) == 1  # it still stores
    assert len(b.segments) == 8 and sorted(b.ready) == kept
    assert sum(len(p.segments) for p in host.pools.values() if p.owner == 1) == 8
    host.invariants()


def test_a_first_segment_below_a_fractional_share_comes_from_the_owner_above_it():
    """3 segments, 2 tenants (share 1.5): A holds 1, B 2. A's new namespace is below the
    share, so it takes B's extra segment, not A's other namespace's only one."""
    arena = Arena(3 * SEG)
    try:
        host = HostPool(arena, SEG)
        b = host.create("b", 4096, owner=2)
        fill(b, "b", 48)
        a1 = host.create("a1", 4096, owner=1)
        fill(a1, "a", 16)
        assert (len(a1.segments), len(b.segments)) == (1, 2)
        a1.pin("a15")  # (before: a2 then stored nothing at all)
        a2 = host.create("a2", 4096, owner=1)
        assert fill(a2, "n", 4) == 4
        assert (len(a1.segments), len(a2.segments), len(b.segments)) == (1, 1, 1)
        assert a1.ready_pages == 16
        host.invariants()
    finally:
        arena.close()


def test_a_reclaim_that_met_write_back_pages_is_not_skipped():
    """write_back keeps unwritten pages while its queue is full: a reclaim that met them
    failed for a while only, so the next grow tries again (no skip of 64 grows)."""
    arena = Arena(2 * SEG)
    try:
        host = HostPool(arena, SEG)
        b = host.create("b", 4096, owner=1)
        fill(b, "b", 32)
        queue_full = [True]
        b.on_evict = lambda pool, e: not queue_full[0]
        a = host.create("a", 4096, owner=2)
        assert a.reserve("a0") is None
        queue_full[0] = False  # the writer drained
        r = a.reserve("a1")
        assert r is not None
        a.commit(r)
        host.invariants()
    finally:
        arena.close()


def test_a_tenant_cannot_reserve_past_its_share_or_take_another_tenants(host):
    b = host.create("b", SEG, owner=2)
    assert fill(b, "b", 6) == 6  # tenant 2: 6 of 16 segments
    with pytest.raises(PoolFull, match="share"):  # the whole pool: refused
        host.create("all", SEG, capacity_bytes=16 * SEG, owner=1)
    assert b.ready_pages == 6  # and nothing of b was evicted
    x = host.create("x", SEG, capacity_bytes=4 * SEG, owner=1)  # half / 2 tenants = 4
    assert len(x.segments) == 4
    with pytest.raises(PoolFull, match="share"):
        host.create("y", SEG, capacity_bytes=SEG, owner=1)
    assert host.create("op", SEG, capacity_bytes=4 * SEG).capacity_pages == 4  # the operator
    assert b.ready_pages == 6
    host.invariants()
