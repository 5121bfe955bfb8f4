"""Moving pages between engine buffers and host-pool slots.

    store: reserve / pin --> Copier.copy(buf, pages, into_engine, settle) --> commit / unpin
                                 |  copy jobs (transports/base.copy_jobs) on the copy lanes
                                 |  (sidecar/lanes.py: per owner uid, never on the loop)
                                 `- settle(ok) on the loop once no job touches the slots

Every byte moves on a copy thread: an engine's buffer is memory its tenant controls (a
lent memfd can be locked, punched or swapped under the copy), so no copy runs on the event
loop. A request waits at most `deadline` seconds for its copy: past it, its pages answer
false and its buffer is marked bad (later moves with it answer false at once), while the
slots stay reserved or pinned until the stuck jobs really end. The store decides which
slots move and what happens to them after (`settle`); this module decides where and how
the bytes move. A page is a (host address, engine slot) pair.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.buffers import Buffer
from sidecar.lanes import Job, Lanes
from sidecar.transports.base import CopyFailed, copy_jobs

log = logging.getLogger("kv_sidecar.store")
COPY_DEADLINE = 30.0  # seconds a request waits for its copy (--copy-deadline)


@dataclass(slots=True)
class CopyTimes:
    """Where the moves that completed spent their time, summed (the operator's
    `/v1/stats` "copies"): `wait_s` from the request's submit to its first job running on
    a copy thread (the hand-off), `copy_s` from there to its last job's end, `settle_s`
    from that end to the loop running it (the wake-up back). `pages` and `runs`: the pages
    those moves copied and the runs (one memmove or device copy each) their plans had:
    runs / pages is 1 where nothing merged, and falls as adjacent pages merge."""

    moves: int = 0
    wait_s: float = 0.0
    copy_s: float = 0.0
    settle_s: float = 0.0
    pages: int = 0
    runs: int = 0


@dataclass(slots=True, eq=False)
class _Move:
    """The jobs of one request's copy: settles once, when the last of them has ended."""

    buf: Buffer
    settle: Callable[[bool], None]
    finished: asyncio.Future
    times: CopyTimes
    submitted: float = 0.0
    pages: int = 0
    runs: int = 0  # the runs its jobs' plans had (`CopyJob.runs`)
    first: float = float("inf")  # the earliest start of its jobs
    last: float = 0.0  # the latest end
    jobs: list[Job] = field(default_factory=list)
    left: int = 0
    failed: bool = False
    abandoned: bool = False  # past its deadline, or its request was cancelled

    def job_ended(self, job: Job) -> None:
        if job.started:
            self.first, self.last = min(self.first, job.started), max(self.last, job.ended)
            self.runs += getattr(job.fn, "runs", 0)
        if job.error is not None:
            self.failed = True
            if isinstance(job.error, CopyFailed):
                log.warning("copy with buffer %s failed: %s", self.buf.id, job.error)
            else:
                log.error("copy with buffer %s failed", self.buf.id, exc_info=job.error)
        self.left -= 1
        if self.left:
            return
        self.jobs = []  # each job's `done` is this move's method: the cycle ends here, and
        self.buf.release_ref()  # the request's objects go by reference count, not the GC
        ok = not (self.failed or self.abandoned)
        if ok:
            t = self.times
            t.moves += 1
            t.wait_s += self.first - self.submitted
            t.copy_s += self.last - self.first
            t.settle_s += time.monotonic() - self.last
            t.pages += self.pages
            t.runs += self.runs
        self.settle(ok)
        if not self.finished.done():
            self.finished.set_result(ok)

    def overdue(self) -> None:
        if not self.finished.done():
            self.finished.set_result(None)

    def abandon(self, lanes: Lanes) -> None:
        """Its request answers now: jobs not started never will; the rest settle later."""
        self.abandoned = True
        for job in self.jobs:
            lanes.drop(job)


class Copier:
    """Runs the copies of set/get for every engine buffer, on `threads` copy threads of
    which one owner's jobs take at most half (and a spare replaces each stuck job)."""

    def __init__(self, threads: int = 2, parallel: int = 2, deadline: float = COPY_DEADLINE):
        per_owner = max(1, threads // 2)
        self.lanes = Lanes("kv-copy", threads, per_owner)
        self.parallel = max(1, min(parallel, per_owner))
        self.deadline = deadline
        self.times = CopyTimes()

    async def copy(
        self,
        buf: Buffer,
        pages: list[tuple[int, int]],
        into_engine: bool,
        settle: Callable[[bool], None],
    ) -> bool:
        """Move (host address, slot) pages on the copy threads, large moves on several
        threads that plan as they copy (`copy_jobs`): the loop only lists the pages.
        `settle(ok)` runs exactly once, on the loop, when no job can touch the slots any
        more (commit or abort, unpin); a request cancelled or past its deadline returns
        first, and its `settle(False)` comes when its last job ends. False when the
        engine's memory failed the copy (it shrank), or the copy overran its deadline."""
        if not pages:
            settle(True)
            return True
        if buf.released or buf.bad:  # released while the request waited; or stuck before
            settle(False)
            return False
        loop = asyncio.get_running_loop()
        move = _Move(buf, settle, loop.create_future(), self.times, time.monotonic(), len(pages))
        try:
            jobs = copy_jobs(buf.mapping, buf.chunks, pages, into_engine, self.parallel)
        except BaseException:
            settle(False)
            raise
        buf.acquire()
        move.left = len(jobs)
        move.jobs = [self.lanes.submit(buf.owner_uid, job, move.job_ended) for job in jobs]
        timer = loop.call_later(self.deadline, move.overdue)
        try:
            ok = await move.finished
        except asyncio.CancelledError:
            move.abandon(self.lanes)
            raise
        finally:
            timer.cancel()
        if ok is None:
            move.abandon(self.lanes)
            buf.bad = f"a copy overran the {self.deadline:g} s copy deadline"
            log.warning(
                "buffer %s (uid %s): a copy overran its %.1f s deadline; the buffer is marked bad",
                buf.id,
                buf.owner_uid,
                self.deadline,
            )
            return False
        return ok
