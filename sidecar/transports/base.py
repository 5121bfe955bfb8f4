"""Engine buffer geometry and copy plans.

Slot i of a buffer holds one page as len(chunks) runs; chunk c of slot i is `size_c` bytes
at `offset_c + i * stride_c`. In the host pool the same page is one contiguous slot:

    engine buffer (K/V split, 2 chunks)           host pool slot
    +--K slot0--+--K slot1--+ ... +--V slot0--+   +----K part----+----V part----+
    ^offset_0   ^offset_0+stride_0  ^offset_1     ^entry.offset  ^+size_0

A copy plan is a list of (dst_address, src_address, nbytes), coalesced where runs touch:
a request whose engine slots and host slots are both adjacent (the host pool hands a
request adjacent slots, pools/page_pool.py) is one run. Every transport runs the same plan
through one small protocol, `Mapping` (below): shm (`shm.py`: memmove, or pread/pwrite in
fd mode) and CUDA IPC (`cuda_ipc.py`: one driver call a plan, one stream sync a job).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sidecar.errors import BadRequest, GeometryMismatch, PayloadTooLarge

MAX_CHUNKS = 4096
MAX_RUNS = 1 << 16  # copies one request may plan (keys x chunks)
YIELD_RUNS = 2048  # runs a copy thread plans and copies before it yields the GIL
SPLIT_MIN = 8 << 20  # moves of fewer bytes stay on one copy thread
_INT = {int}


class Mapping(Protocol):
    """An engine buffer opened in the sidecar: what a copy plan runs against.

    Made on an fd thread (`sidecar/lanes.py`) when the buffer is registered, and from then
    on owned by the registry: the engine's memory stays the engine's, the mapping (an
    mmap, a dup of the lent fd, opened IPC handles) is the sidecar's until `close`.
    """

    @property
    def addresses(self) -> list[int]:
        """Base address of each region, in the sidecar's address space (shm: a mapping
        address, or file offset 0 in fd mode; CUDA IPC: a device pointer). Chunk offsets
        are relative to these. Constant for the mapping's life; never raises."""
        ...

    def run_plan(self, plan: Sequence[tuple[int, int, int]], into_engine: bool) -> int:
        """Run (dst, src, n) copies between the host arena and the engine's memory; the
        bytes moved, once every copy has completed (CUDA: the stream synchronized).

        A copy thread only, never the event loop: the engine's memory can block (a held
        inode lock, FUSE) and a device copy waits for the GPU. The host addresses are
        pool slots the caller holds reserved (a set) or pinned (a get) for the whole call;
        the engine addresses lie inside `addresses` by the plan's construction. Raises
        `CopyFailed` when the engine's side cannot be read or written (a file that shrank,
        a failed device copy): the request's pages answer false. Any other exception fails
        them the same way but is logged with its traceback, as a bug (`sidecar/copier.py`)."""
        ...

    # Optional: `run_plans(plans, into_engine) -> int`, the plans of one job (an iterator,
    # planned as it is read) run as `run_plan` runs one, waited for once at the end (CUDA:
    # each plan submitted as it comes, the stream synchronized once). `copy_pages` uses it
    # where a mapping has it.

    def close(self) -> None:
        """Release what the mapping holds (unmap, close the fd, close the IPC handles).

        An fd thread, once, after every copy that used the mapping has ended; nothing is
        called after it. Never raises."""
        ...


class CopyFailed(Exception):
    """A copy could not complete (the engine's memory shrank or failed): the pages of
    that request answer false. Not a caller error, so not a SidecarError."""


@dataclass(frozen=True, slots=True)
class Chunk:
    offset: int
    stride: int
    size: int
    region: int = 0  # which memory region of the buffer (cuda_ipc: one per allocation)


def _nonneg_int(value: Any, what: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequest(f"{what} must be an integer >= {minimum}")
    return value


def parse_chunks(raw: Any, page_bytes: int, size, slots: int) -> tuple[Chunk, ...]:
    """Validate chunk descriptors against the namespace page size and the region sizes
    (`size`: the buffer's size, or a list with one size per region)."""
    sizes = list(size) if isinstance(size, (list, tuple)) else [size]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'chunks' must be a non-empty list of {offset, stride, size}")
    if len(raw) > MAX_CHUNKS:
        raise BadRequest(f"'chunks' has {len(raw)} entries; at most {MAX_CHUNKS}")
    chunks = []
    for i, c in enumerate(raw):
        if not isinstance(c, dict) or not {"offset", "stride", "size"} <= set(c) <= {
            "offset",
            "stride",
            "size",
            "region",
        }:
            raise BadRequest(
                f"chunks[{i}] must be an object with offset, stride, size (and region)"
            )
        chunk = Chunk(
            _nonneg_int(c["offset"], f"chunks[{i}].offset"),
            _nonneg_int(c["stride"], f"chunks[{i}].stride"),
            _nonneg_int(c["size"], f"chunks[{i}].size", 1),
            _nonneg_int(c.get("region", 0), f"chunks[{i}].region"),
        )
        if chunk.region >= len(sizes):
            raise BadRequest(
                f"chunks[{i}].region {chunk.region} is not one of the buffer's {len(sizes)} regions"
            )
        end = chunk.offset + (slots - 1) * chunk.stride + chunk.size
        if end > sizes[chunk.region]:
            raise GeometryMismatch(
                f"chunks[{i}] of slot {slots - 1} ends at byte {end}, "
                f"past its region's size {sizes[chunk.region]}"
            )
        chunks.append(chunk)
    total = sum(c.size for c in chunks)
    if total != page_bytes:
        raise GeometryMismatch(
            f"chunk sizes sum to {total} bytes; the namespace's page_bytes is {page_bytes}"
        )
    return merge_chunks(chunks)


def covered(chunks: Sequence[Chunk], slots: int) -> tuple[int, int]:
    """(first, end): the bytes of region 0 that the chunks of `slots` slots cover, from the
    first chunk byte to the last (what an shm buffer maps, not its whole size)."""
    first = min(c.offset for c in chunks)
    return first, max(c.offset + (slots - 1) * c.stride + c.size for c in chunks)


def merge_chunks(chunks: Sequence[Chunk]) -> tuple[Chunk, ...]:
    """Fold each chunk into the one before it when it continues it in every slot (same
    region and stride, starting where it ends): fewer, longer runs per page."""
    out: list[Chunk] = []
    for c in chunks:
        last = out[-1] if out else None
        if (
            last is not None
            and (last.region, last.stride) == (c.region, c.stride)
            and last.offset + last.size == c.offset
        ):
            out[-1] = Chunk(last.offset, last.stride, last.size + c.size, last.region)
        else:
            out.append(c)
    return tuple(out)


def check_runs(keys: int, chunks: int) -> None:
    """Bound a request's copy plan: keys x chunks runs (413 beyond MAX_RUNS)."""
    if keys * chunks > MAX_RUNS:
        raise PayloadTooLarge(
            f"{keys} keys x {chunks} chunks is {keys * chunks} copies; at most "
            f"{MAX_RUNS} a request: send fewer keys, or register the buffer "
            f"with fewer, larger chunks"
        )


def check_slots(slots: Any, count: int, buffer_slots: int) -> list[int]:
    """One slot per key, each in range of the buffer."""
    if not isinstance(slots, list) or len(slots) != count:
        raise BadRequest(f"'slots' must be a list with one entry per key ({count})")
    if slots and set(map(type, slots)) == _INT and min(slots) >= 0 and max(slots) < buffer_slots:
        return slots  # the usual case, checked in C; the loop below names what is wrong
    for s in slots:
        if not isinstance(s, int) or isinstance(s, bool):
            raise BadRequest("'slots' must hold integers")
        if not 0 <= s < buffer_slots:
            raise GeometryMismatch(f"slot {s} is out of range: the buffer has {buffer_slots} slots")
    return slots


def build_plan(
    chunks: Sequence[Chunk],
    bases: Sequence[int],
    pages: Sequence[tuple[int, int]],
    into_engine: bool,
) -> list[tuple[int, int, int]]:
    """The coalesced plan moving each (host address, slot) page of `pages` between the host
    pool and the engine buffer, in one pass: one (dst, src, n) per run that does not
    continue the one before. Runs are followed as (engine, host, n) and turned into
    (dst, src, n) as each one closes."""
    runs, page_off = [], 0
    for c in chunks:
        runs.append((bases[c.region] + c.offset, c.stride, page_off, c.size))
        page_off += c.size
    if len(runs) == 1:
        return _plan_one_run(runs[0], pages, into_engine)
    out: list[tuple[int, int, int]] = []  # tuples of ints: untracked at the next GC pass
    le, lh, ln = 0, 0, -1  # no run ends where a real one starts
    for host, slot in pages:
        for engine, stride, off, n in runs:
            e, h = engine + slot * stride, host + off
            if le + ln == e and lh + ln == h:
                ln += n
            else:
                if ln > 0:
                    out.append((le, lh, ln) if into_engine else (lh, le, ln))
                le, lh, ln = e, h, n
    if ln > 0:
        out.append((le, lh, ln) if into_engine else (lh, le, ln))
    return out


def _plan_one_run(
    run: tuple[int, int, int, int], pages: Sequence[tuple[int, int]], into_engine: bool
) -> list[tuple[int, int, int]]:
    """`build_plan` for a page that is one run in the engine's buffer (the usual layout):
    the same plan, without the inner loop. Kept apart on purpose: one loop fed by a
    generator for both cases plans 64 pages in 13.6 us against 9.1 us here."""
    engine, stride, _, n = run
    out: list[tuple[int, int, int]] = []
    le, lh, ln = 0, 0, -1
    for host, slot in pages:
        e = engine + slot * stride
        if le + ln == e and lh + ln == host:
            ln += n
        else:
            if ln > 0:
                out.append((le, lh, ln) if into_engine else (lh, le, ln))
            le, lh, ln = e, host, n
    if ln > 0:
        out.append((le, lh, ln) if into_engine else (lh, le, ln))
    return out


class CopyJob:
    """One copy thread's share of a move, called on that thread: its pages (planned as they
    copy, `copy_pages`) or its part of a plan cut by bytes; the bytes moved. `runs` counts
    the runs it handed to the transport (`/v1/stats` copies: runs per page)."""

    __slots__ = ("chunks", "into_engine", "mapping", "pages", "plan", "runs")

    def __init__(self, mapping, chunks, pages, into_engine: bool, plan=None):
        self.mapping, self.chunks, self.pages = mapping, chunks, pages
        self.into_engine, self.plan, self.runs = into_engine, plan, 0

    def __call__(self) -> int:
        if self.plan is not None:
            self.runs = len(self.plan)
            return self.mapping.run_plan(self.plan, self.into_engine)
        return copy_pages(self.mapping, self.chunks, self.pages, self.into_engine, self)


def copy_pages(
    mapping,
    chunks: Sequence[Chunk],
    pages: Sequence[tuple[int, int]],
    into_engine: bool,
    job: CopyJob | None = None,
) -> int:
    """Move `pages` on this (copy) thread: plan and run YIELD_RUNS runs at a time, then let
    the event loop's thread take the GIL. The plan of a request is never whole in memory,
    and no copy thread holds the GIL for long (a 65,536-run move once stalled the loop).
    A mapping with `run_plans` takes the plans as they come and waits once."""
    plans = _plans(mapping, chunks, pages, into_engine, job)
    run_plans = getattr(mapping, "run_plans", None)
    if run_plans is not None:
        return run_plans(plans, into_engine)
    return sum(mapping.run_plan(plan, into_engine) for plan in plans)


def _plans(mapping, chunks, pages, into_engine: bool, job: CopyJob | None):
    step = max(1, YIELD_RUNS // len(chunks))
    for i in range(0, len(pages), step):
        if i:
            time.sleep(0)
        plan = build_plan(chunks, mapping.addresses, pages[i : i + step], into_engine)
        if job is not None:
            job.runs += len(plan)
        yield plan


def copy_jobs(
    mapping,
    chunks: Sequence[Chunk],
    pages: Sequence[tuple[int, int]],
    into_engine: bool,
    parts: int,
) -> list[CopyJob]:
    """One move as jobs for up to `parts` copy threads, cut by pages (all the same size).
    A move of fewer pages than threads is planned here (at most parts x MAX_CHUNKS runs)
    and its plan cut by bytes."""
    total = len(pages) * sum(c.size for c in chunks)
    if parts <= 1 or total < SPLIT_MIN:
        return [CopyJob(mapping, chunks, pages, into_engine)]
    if len(pages) >= parts:
        per = -(-len(pages) // parts)
        return [
            CopyJob(mapping, chunks, pages[i : i + per], into_engine)
            for i in range(0, len(pages), per)
        ]
    plan = build_plan(chunks, mapping.addresses, pages, into_engine)
    return [
        CopyJob(mapping, chunks, (), into_engine, part)
        for part in split_plan(plan, parts, SPLIT_MIN)
    ]


def split_plan(
    plan: list[tuple[int, int, int]], parts: int, minimum: int = SPLIT_MIN
) -> list[list]:
    """Cut a plan into up to `parts` slices of about equal bytes (runs are split too), so
    one large request copies on several threads. Plans under `minimum` bytes stay whole."""
    total = sum(n for _, _, n in plan)
    if parts <= 1 or total < minimum:
        return [plan]
    share = -(-total // parts)
    out: list[list] = [[]]
    room = share
    for dst, src, n in plan:
        while n:
            take = min(n, room)
            out[-1].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
            if room == 0 and len(out) < parts:
                out.append([])
                room = share
    return [p for p in out if p]
