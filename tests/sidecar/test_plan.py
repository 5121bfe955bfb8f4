"""Copy plans (issue 11, item 6): built by the copy threads a slice at a time, coalesced
in one pass, and cut by pages for parallel threads; every byte lands once."""

from __future__ import annotations

import ctypes
import os

from sidecar.transports import base
from sidecar.transports.base import Chunk, build_plan, copy_jobs
from sidecar.transports.shm import run_plan


class Memory:
    """An engine buffer in plain memory: `run_plan` as the mmap transport runs it."""

    def __init__(self, size: int):
        self.buf = ctypes.create_string_buffer(os.urandom(size), size)
        self.addresses = [ctypes.addressof(self.buf)]
        self.plans = 0

    def run_plan(self, plan, into_engine):
        self.plans += 1
        return run_plan(plan)


def test_build_plan_coalesces_touching_runs_across_pages():
    page_first = (Chunk(0, 16, 8), Chunk(8, 16, 8))  # not merged: runs still touch
    plan = build_plan(page_first, [1000], [(5000, 0), (5016, 1), (9000, 3)], into_engine=False)
    assert plan == [(5000, 1000, 32), (9000, 1048, 16)]
    assert build_plan(page_first, [1000], [(5000, 2)], into_engine=True) == [(1032, 5000, 16)]


def test_large_moves_are_cut_by_pages_and_planned_a_slice_at_a_time(monkeypatch):
    monkeypatch.setattr(base, "SPLIT_MIN", 1)
    monkeypatch.setattr(base, "YIELD_RUNS", 64)
    slots, chunks = 100, tuple(Chunk(c * 100 * 8, 8, 8) for c in range(4))  # layer-first
    engine = Memory(slots * 32)
    host = ctypes.create_string_buffer(slots * 32)
    pages = [(ctypes.addressof(host) + (99 - i) * 32, i) for i in range(slots)]  # reversed
    jobs = copy_jobs(engine, chunks, pages, False, parts=3)
    assert len(jobs) == 3
    assert sum(job() for job in jobs) == slots * 32
    assert engine.plans == 3 * 3 - 1  # 34 + 34 + 32 pages, 16 pages (64 runs) a plan
    raw = engine.buf.raw
    for i in range(slots):
        want = b"".join(raw[c * 800 + i * 8 : c * 800 + i * 8 + 8] for c in range(4))
        assert host.raw[(99 - i) * 32 : (100 - i) * 32] == want


def test_a_move_of_few_large_pages_is_cut_by_bytes(monkeypatch):
    monkeypatch.setattr(base, "SPLIT_MIN", 1)
    engine = Memory(4096)
    host = ctypes.create_string_buffer(4096)
    jobs = copy_jobs(engine, (Chunk(0, 4096, 4096),), [(ctypes.addressof(host), 0)], False, parts=2)
    assert len(jobs) == 2 and sum(job() for job in jobs) == 4096
    assert host.raw == engine.buf.raw


def _reference_plan(chunks, bases, pages, into_engine):
    """One (dst, src, n) per chunk of each page, then coalesced: what build_plan must equal."""
    runs = []
    for host, slot in pages:
        off = 0
        for c in chunks:
            engine = bases[c.region] + c.offset + slot * c.stride
            runs.append(
                (engine, host + off, c.size) if into_engine else (host + off, engine, c.size)
            )
            off += c.size
    out: list[list[int]] = []
    for dst, src, n in runs:  # merge a run into the one before when both sides touch it
        if out and out[-1][0] + out[-1][2] == dst and out[-1][1] + out[-1][2] == src:
            out[-1][2] += n
        else:
            out.append([dst, src, n])
    return [tuple(x) for x in out]


def test_build_plan_equals_the_plain_plan_coalesced():
    """The one-run fast path and the general loop give the per-chunk plan, coalesced, for
    contiguous, reversed, repeated and random pages, in both directions."""
    import random

    rng = random.Random(13)
    layouts = [
        (Chunk(0, 4096, 4096),),
        (Chunk(0, 4096, 2048), Chunk(2048, 4096, 2048)),
        (Chunk(0, 4096, 1024), Chunk(1 << 20, 4096, 3072)),
        (Chunk(0, 4096, 1024, 0), Chunk(0, 4096, 3072, 1)),
    ]
    page_lists = [
        [(1 << 30 | i * 4096, i) for i in range(64)],
        [(1 << 30 | (63 - i) * 4096, i) for i in range(64)],
        [(1 << 30, 3), (1 << 30, 3)],
        [],
        [(1 << 30 | rng.randrange(100) * 4096, rng.randrange(64)) for _ in range(300)],
    ]
    for chunks in layouts:
        for pages in page_lists:
            for into_engine in (True, False):
                want = _reference_plan(chunks, [1 << 40, 1 << 41], pages, into_engine)
                assert build_plan(chunks, [1 << 40, 1 << 41], pages, into_engine) == want
    assert len(build_plan(layouts[0], [1 << 40], page_lists[0], True)) == 1  # one memmove
