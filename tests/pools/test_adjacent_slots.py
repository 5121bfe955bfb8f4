"""Adjacent slots (issue 54): a request's pages, reserved one after another, land in adjacent
slots wherever free slots allow, so its copies merge into long runs on the host side
(pools/page_pool.py, "Adjacent slots"); scattered free slots are still all used."""

from __future__ import annotations

import random

from pools.page_pool import PagePool

PAGE = 4096


def pool(pages: int = 64, segments: int = 1) -> PagePool:
    p = PagePool("p", PAGE, pages * PAGE, max_pages=pages * segments)
    for seg in range(segments):
        p.add_segment(seg)
    return p


def slots(p: PagePool, keys: list[str]) -> list[int]:
    """The slot numbers the keys' reservations got, in request order."""
    out = []
    for k in keys:
        e = p.reserve(k)
        out.append(e.offset // PAGE)
        p.commit(e)
    return out


def adjacent(got: list[int]) -> bool:
    return got == list(range(got[0], got[0] + len(got)))


def test_a_fresh_pool_places_a_request_in_a_row():
    p = pool()
    assert slots(p, [f"a{i}" for i in range(20)]) == list(range(20))
    assert adjacent(slots(p, [f"b{i}" for i in range(20)]))
    p.invariants()


def test_pages_deleted_in_order_or_reversed_come_back_in_address_order():
    """Before: given-back slots were a stack, so a request got them in reverse (one run a
    page). Now the next request gets them ascending, whichever order they came back in."""
    for order in (list, reversed):
        p = pool()
        first = slots(p, [f"a{i}" for i in range(16)])
        slots(p, [f"b{i}" for i in range(16)])
        for i in order(range(16)):
            p.delete(f"a{i}")
        assert slots(p, [f"c{i}" for i in range(16)]) == first
        p.invariants()


def test_a_full_pool_gives_the_evicted_requests_slots_in_their_order():
    """Every reserve evicts the least recent page: an earlier request's, in its order, so
    the new request's pages take its slots in a row."""
    p = pool(pages=32)
    slots(p, [f"a{i}" for i in range(16)])
    slots(p, [f"b{i}" for i in range(16)])
    assert slots(p, [f"c{i}" for i in range(16)]) == list(range(16))
    assert slots(p, [f"d{i}" for i in range(16)]) == list(range(16, 32))
    assert p.evictions == 32
    p.invariants()


def test_a_request_continues_across_adjacent_segments():
    p = PagePool("p", PAGE, 8 * PAGE, grow=lambda pool: bool(pool.add_segment(len(pool.segments))))
    assert slots(p, [f"a{i}" for i in range(20)]) == list(range(20))  # 3 segments, one row
    p.invariants()


def test_scattered_free_slots_are_all_used_first_then_a_row():
    p = pool()
    slots(p, [f"a{i}" for i in range(48)])
    gone = random.Random(54).sample(range(48), 10)
    for i in gone:
        p.delete(f"a{i}")
    got = slots(p, [f"c{i}" for i in range(20)])
    assert sorted(got[:10]) == sorted(gone)  # given-back slots are reused first
    assert got[10:] == list(range(48, 58))  # then fresh ones, in a row
    assert len(set(got)) == 20
    p.invariants()


def test_a_row_of_given_back_slots_is_found_from_its_top():
    """A new run starts at the lowest free slot of the row below the last slot given back,
    so a request reading a row upward gets it whole."""
    p = pool()
    slots(p, [f"a{i}" for i in range(40)])
    for i in (30, 31, 32, 33, 5):  # a row, then a lone slot given back last
        p.delete(f"a{i}")
    assert slots(p, ["x"]) == [5]  # the lone one: the last given back
    assert slots(p, [f"y{i}" for i in range(4)]) == [30, 31, 32, 33]
    p.invariants()


def test_a_row_of_given_back_slots_is_read_with_one_run_start(monkeypatch):
    """Each page after the first takes the slot after the last one at once: a row is one
    walk down to its start, not one a page (8,192 pages would walk 2 million slots)."""
    p = pool()
    slots(p, [f"a{i}" for i in range(64)])
    for i in range(64):
        p.delete(f"a{i}")
    starts = []
    real = PagePool._run_start
    monkeypatch.setattr(PagePool, "_run_start", lambda self: starts.append(1) or real(self))
    assert slots(p, [f"b{i}" for i in range(64)]) == list(range(64))
    assert len(starts) == 1
