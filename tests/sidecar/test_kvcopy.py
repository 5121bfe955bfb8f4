"""The copy of a plan's runs in C (sidecar/_kvcopy.c, through sidecar/transports/shm.py's
`run_plan`): the same bytes as memmove run by run, streamed or not, at any alignment and
length, overlapping runs included; bad input raises, never crashes; and a mapped buffer's
plan is one call into C however many runs it has (issue 44: a 192 MiB restore is 3,072
runs of 64 KiB, each a ctypes call and a GIL round trip before)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest

from sidecar.transports import shm

kvcopy = shm._kvcopy
needs_kvcopy = pytest.mark.skipif(
    kvcopy is None and not os.environ.get("KV_SIDECAR_CI"),
    reason="sidecar/_kvcopy.c not built (no C compiler at install)",
)
SIZE = 1 << 20


class Arena:
    """Two anonymous mappings, `a` random and `b` zeros, with their addresses."""

    def __init__(self):
        self.a, self.b = mmap.mmap(-1, SIZE), mmap.mmap(-1, SIZE)
        self.a[:] = os.urandom(SIZE)
        self.pa = ctypes.addressof(ctypes.c_char.from_buffer(self.a))
        self.pb = ctypes.addressof(ctypes.c_char.from_buffer(self.b))

    def expected(self, plan: list[tuple[int, int, int]]) -> bytes:
        """`b` after the plan run with memmove, run by run (the reference), on copies."""
        ref = bytearray(self.a[:]) + bytearray(self.b[:])
        base = {self.pa: 0, self.pb: SIZE}
        for dst, src, n in plan:
            d, s = self._at(dst, base), self._at(src, base)
            ref[d : d + n] = ref[s : s + n]
        return bytes(ref[SIZE:])

    def _at(self, address: int, base: dict) -> int:
        for start, off in base.items():
            if start <= address < start + SIZE:
                return off + address - start
        raise AssertionError("an address outside both mappings")


@needs_kvcopy
@pytest.mark.parametrize("stream_min", [0, 1 << 62])  # every plan streamed; none
@pytest.mark.parametrize("misalign", [(0, 0), (1, 0), (0, 7), (13, 3), (63, 64)])
def test_runs_copy_the_bytes_memmove_copies(stream_min, misalign):
    m = Arena()
    da, sa = misalign
    plan = [
        (m.pb + da, m.pa + sa, 65536),  # a long run: head to 16-byte alignment, 64 B body, tail
        (m.pb + 70000 + da, m.pa + 200000 + sa, 255),  # under the stream size: memmove
        (m.pb + 80000, m.pa + 300000 + sa, 256 + 63),  # streamed with a tail
        (m.pb + 90000 + da, m.pa + 1, 1),
        (m.pb + 100000, m.pa, 0),
    ]
    assert kvcopy.run_plan(plan, stream_min) == sum(n for _, _, n in plan)
    assert m.b[:] == m.expected(plan)


@needs_kvcopy
@pytest.mark.parametrize("stream_min", [0, 1 << 62])
def test_overlapping_runs_move_as_memmove_does(stream_min):
    m = Arena()
    plan = [(m.pb, m.pa, 8192), (m.pb + 100, m.pb, 4096), (m.pb + 5000, m.pb + 5100, 3000)]
    assert kvcopy.run_plan(plan, stream_min) == 8192 + 4096 + 3000
    assert m.b[:] == m.expected(plan)


@needs_kvcopy
@pytest.mark.parametrize(
    "plan",
    [
        [(1, 2)],
        [[1, 2, 3]],
        [(1, 2, -1)],
        [(-1, 2, 3)],
        [(1, 2, 3.0)],
        [(1 << 64, 2, 3)],
        ["abc"],
    ],
)
def test_bad_runs_raise_before_any_copy(plan):
    with pytest.raises((TypeError, OverflowError)):
        kvcopy.run_plan(plan, 0)


@needs_kvcopy
def test_only_a_list_is_a_plan():
    with pytest.raises(TypeError):
        kvcopy.run_plan(((1, 2, 3),), 0)
    assert kvcopy.run_plan([], 0) == 0


@needs_kvcopy
def test_a_mapped_buffers_plan_is_one_call_into_c_however_many_runs():
    m = Arena()
    plan = [(m.pb + i * 4096, m.pa + i * 4096, 4096) for i in range(SIZE // 4096)]
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "c_call":
            calls.append(getattr(arg, "__name__", repr(arg)))

    sys.setprofile(profile)
    try:
        moved = shm.run_plan(plan)
    finally:
        sys.setprofile(None)
    assert moved == SIZE and m.b[:] == m.a[:]
    assert calls.count("run_plan") == 1 and len(calls) <= 2, calls[:5]  # + setprofile(None)
