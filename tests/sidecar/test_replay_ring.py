"""The replay ring's mapping (sidecar/replay_ring.py): batches written round, each kept one
read back whole, no two overlapping, the oldest dropped first, a replay that meets an
overwritten batch skipping it."""

from __future__ import annotations

import itertools
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.replay_ring import ReplayRing


def check(ring: ReplayRing, written: dict) -> None:
    """Invariants: the kept batches are the newest, in order, inside the mapping, disjoint,
    their bytes counted, each read back as written."""
    index = list(ring.index)
    seqs = [e[0] for e in index]
    assert seqs == sorted(seqs) and (not seqs or seqs == list(range(seqs[0], seqs[-1] + 1)))
    assert not seqs or seqs[-1] == max(written)
    spans = sorted((off, off + n) for _, _, off, n in index)
    assert all(0 <= a <= b <= ring.size for a, b in spans)
    assert all(b1 <= a2 for (_, b1), (a2, _) in itertools.pairwise(spans))
    assert ring.bytes == sum(n for *_, n in index) and len(ring) <= ring.keep
    assert {seq: p for seq, _, p in ring.since(0)} == {seq: written[seq] for seq in seqs}


@settings(max_examples=200, deadline=None)
@given(
    keep=st.integers(1, 8), size=st.integers(1, 64), sizes=st.lists(st.integers(0, 80), max_size=40)
)
def test_the_ring_keeps_the_newest_batches_whole(keep, size, sizes):
    ring, written = ReplayRing(keep, size), {}
    try:
        for seq, n in enumerate(sizes):
            written[seq] = bytes([seq % 251]) * n
            ring.add(seq, b"t", written[seq])
            check(ring, written)
            if n > size:
                assert len(ring) == 0  # nothing older is replayed past a batch not kept
            else:
                assert ring.seqs()[-1] == seq
    finally:
        ring.close()


def test_a_wrap_drops_the_older_lap_and_what_the_batch_covers():
    ring = ReplayRing(100, 10)
    for seq, n in enumerate([4, 4, 4]):  # 0 at [0,4), 1 at [4,8), 2 wraps to [0,4)
        ring.add(seq, b"t", b"x" * n)
    assert [(s, off) for s, _, off, _ in ring.index] == [(1, 4), (2, 0)]
    ring.add(3, b"t", b"y" * 6)  # [4,10): covers 1
    assert [(s, off) for s, _, off, _ in ring.index] == [(2, 0), (3, 4)]
    ring.add(4, b"t", b"z" * 3)  # wraps: covers 2 only
    assert ring.seqs() == [3, 4] and ring.bytes == 9


def test_a_wrap_drops_an_older_batch_past_the_head_that_the_new_one_does_not_reach():
    ring, written = ReplayRing(100, 10), {}
    for seq, n in enumerate([3, 3, 3, 1, 2]):  # 4 wraps to [0,2): 1 [3,6) 2 [6,9) 3 [9,10) left
        written[seq] = bytes([seq]) * n
        ring.add(seq, b"t", written[seq])
    assert ring.seqs() == [1, 2, 3, 4]
    written[5] = b"\x05" * 9  # from 2 it would not fit: wraps to [0,9), and 3
    ring.add(5, b"t", written[5])  # at [9,10), older than 4, goes with the lap
    check(ring, written)
    assert ring.seqs() == [5]


def test_a_replay_skips_a_batch_overwritten_while_it_ran():
    ring = ReplayRing(100, 8)
    for seq in range(2):
        ring.add(seq, b"t", bytes([seq]) * 4)
    replay = ring.since(0)
    assert next(replay) == (0, b"t", b"\x00" * 4)
    ring.add(2, b"t", b"\x02" * 4)  # overwrites 1 ... and 0, already sent
    ring.add(3, b"t", b"\x03" * 4)
    assert list(replay) == []  # 1 is gone: skipped, never read torn
    assert [s for s, _, _ in ring.since(0)] == [2, 3]


def test_the_loop_writes_while_a_replay_copies():
    """Replays from another thread during writes read only whole batches."""
    ring, stop, bad = ReplayRing(1000, 1 << 16), threading.Event(), []

    def reader():
        while not stop.is_set():
            bad.extend(seq for seq, _, p in ring.since(0) if p != bytes([seq % 256]) * len(p))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for seq in range(5000):
            ring.add(seq, b"t", bytes([seq % 256]) * (1000 + seq % 3000))
    finally:
        stop.set()
        t.join()
        ring.close()
    assert bad == []


def test_no_mapping_without_replay_and_close_ends_reads():
    assert ReplayRing(0, 1 << 20).map is None and ReplayRing(5, 0).map is None
    ring = ReplayRing(5, 64)
    ring.add(0, b"t", b"a")
    replay = ring.since(0)
    ring.close()
    assert list(replay) == [] and len(ring) == 0 and ring.bytes == 0


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_the_mapping_is_resident_from_the_start():
    """Its pages are taken when the ring is made (MAP_POPULATE): the RSS an operator sees
    at start holds the ring, and no batch's first write takes a page fault."""
    before = resident_bytes()
    ring = ReplayRing(10, 32 << 20)
    try:
        assert resident_bytes() - before >= 30 << 20
    finally:
        ring.close()
