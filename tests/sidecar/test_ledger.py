"""One ledger per owner (issue 52): every hold of an owner (gets and sets in flight,
answers nobody reads, uploads, pins) is charged by the segments it keeps busy, and never
past the owner's fair share, so another owner always keeps room to grow into its own.

Before: pins and uploads had caps of their own; copies in flight had none. A tenant that
filled the pool while alone kept gets of its own pages in flight on 16 connections and a
victim's sets stored 0 of 64 for as long as it kept them up.
"""

from __future__ import annotations

import random

import pytest

from pools import Arena, HostPool
from sidecar.errors import TooMany
from sidecar.ledger import Ledger

SEG = 2**20
PAGE = 64 * 2**10  # 16 pages a segment
A, B = 1000, 1001


@pytest.fixture
def host():
    arena = Arena(16 * SEG)
    yield HostPool(arena, SEG)
    arena.close()


def fill(pool, prefix: str, n: int) -> list:
    out = []
    for i in range(n):
        e = pool.reserve(f"{prefix}{i}")
        assert e is not None and pool.commit(e)
        out.append(pool.ready[f"{prefix}{i}"])
    return out


def test_an_owner_alone_holds_every_segment_and_half_once_another_comes(host):
    ledger = Ledger(host)
    a = host.create("a", PAGE, owner=A)
    pages = fill(a, "k", 16 * 16)  # the whole pool, one owner
    hold = ledger.hold(A)
    assert all(hold.take(e.offset for e in pages))  # alone: its share is every segment
    hold.release()
    assert ledger.held(A) == 0 and ledger.accounts == {}
    host.create("b", PAGE, owner=B)  # an owner comes: A's bound is half the segments
    assert ledger.bound(A) == 8 and ledger.bound(B) == 8
    hold = ledger.hold(A)
    got = hold.take(e.offset for e in pages)
    assert sum(got) == 8 * 16 and ledger.held(A) == 8  # whole segments, never a ninth
    assert ledger.refused == 8 * 16 and ledger.usage(A)["refused"] == 8 * 16
    hold.release()
    ledger.invariants()


def test_a_hold_given_back_twice_raises(host):
    ledger = Ledger(host)
    hold = ledger.hold(A)
    assert hold.take([0]) == [True]
    segs = dict(hold.segs)
    hold.release()
    with pytest.raises(KeyError):
        ledger.give(A, segs)
    ledger.pin(A, 3)
    ledger.unpin(A, 3)
    ledger.pin(A, 4)
    with pytest.raises(AssertionError):
        ledger.unpin(A, 5)


def test_uploads_in_flight_are_capped_per_owner_and_in_all(host):
    ledger = Ledger(host)
    host.create("a", PAGE, owner=A)
    host.create("b", PAGE, owner=B)
    ledger.upload(A, 1)
    ledger.upload(A, 1)  # 16 segments / 8 = 2 an owner
    with pytest.raises(TooMany):
        ledger.check_upload(A)
    ledger.check_upload(B)
    ledger.upload(A, -1)
    ledger.check_upload(A)
    ledger.upload(A, -1)
    with pytest.raises(AssertionError):
        ledger.upload(A, -1)


@pytest.mark.parametrize("seed", range(5))
def test_random_holds_of_two_owners_never_keep_either_below_its_share(host, seed):
    """Random gets, answers and pins of two owners (some never let go: stalled clients)
    over a pool A filled alone: after every step neither holds past its bound, and the
    segments A keeps busy leave B at least its share to grow into."""
    rnd = random.Random(seed)
    ledger = Ledger(host)
    a = host.create("a", PAGE, owner=A)
    pages = {A: fill(a, "a", 16 * 16)}
    b = host.create("b", PAGE, owner=B)
    pages[B] = []
    holds: list = []
    for step in range(400):
        owner = rnd.choice((A, B))
        op = rnd.random()
        if op < 0.5 and pages[owner]:  # a get or an answer: some pages, held a while
            hold = ledger.hold(owner)
            hold.take(e.offset for e in rnd.sample(pages[owner], min(8, len(pages[owner]))))
            holds.append(hold)
        elif op < 0.6 and pages[owner]:  # a pin, within both bounds
            e = rnd.choice(pages[owner])
            seg = e.offset // SEG
            if ledger.may_pin(owner, {seg}, ledger.pin_bound(owner), ledger.bound(owner)):
                ledger.pin(owner, seg)
        elif op < 0.9 and holds:  # a client ends (some never do: the ones left at the end)
            holds.pop(rnd.randrange(len(holds))).release()
        elif owner == B:  # B stores: it grows into segments A does not keep busy
            e = b.reserve(f"b{step}")
            if e is not None and e is not b.ready.get(f"b{step}"):
                assert b.commit(e)
                pages[B].append(b.ready[f"b{step}"])
        ledger.invariants()
        host.invariants()
        for o in (A, B):
            assert ledger.held(o) <= ledger.bound(o), (step, o)
        assert host.n_segments - ledger.held(A) >= ledger.bound(B), step
    # B grew into its share although A never let go of what it held
    assert len(b.segments) >= 1
    for hold in holds:
        hold.release()
    ledger.invariants()
