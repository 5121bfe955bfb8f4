"""Threads for work that may block on memory or descriptors a tenant controls, so that it
never runs on the event loop: copies from and to lent buffers (`sidecar.copier`), and
receiving, checking, registering and closing lent fds (`sidecar.leases`, `sidecar.buffers`).

    owner A (a uid): [job][job][job] --at most per_owner at once--+
    owner B:         [job]           ----------------------------+--> shared threads
                                                                     (threads + spares)

One owner's jobs start in the order they were submitted and at most `per_owner` of them
run at once, so an owner whose jobs block holds at most that many threads. A job running
longer than STUCK_AFTER seconds gets a spare thread started in its place (MAX_SPARES at
most), so the other owners keep every thread: a tenant's stuck copies or closes cost that
tenant, never the others. State lives on the event loop; threads only run jobs and report
back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kv_sidecar.lanes")
STUCK_AFTER = 1.0  # seconds a job may run before a spare thread takes its place
MAX_SPARES = 64  # spare threads at most (each stands in for one stuck job)


@dataclass(slots=True, eq=False)
class Job:
    """One call of `fn` on a lane thread; `done(job)` runs on the loop once it has ended
    (`state` "ended", with `result` or `error`) or was dropped before it started."""

    fn: Callable[[], Any]
    owner: Any
    done: Callable[[Job], None] | None = None
    state: str = "queued"  # queued -> running -> ended, or queued -> dropped
    result: Any = None
    error: BaseException | None = None
    started: float = 0.0  # time.monotonic() when a thread took it (0: not yet)
    ended: float = 0.0  # time.monotonic() when its `fn` returned or raised
    stuck: bool = False


@dataclass(slots=True, eq=False)
class _Lane:
    running: int = 0
    waiting: deque = field(default_factory=deque)


class Lanes:
    """Per-owner lanes over `threads` shared threads (started on first use; like daemons,
    a job stuck in the kernel never holds the process at exit)."""

    def __init__(self, name: str, threads: int, per_owner: int):
        assert threads >= 1 and per_owner >= 1
        self.name, self.threads, self.per_owner = name, threads, per_owner
        self.loop: asyncio.AbstractEventLoop | None = None
        self.spares = 0
        self._lanes: dict[Any, _Lane] = {}
        self._running: set[Job] = set()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = 0
        self._watching = False

    # -- on the loop -----------------------------------------------------------------
    def submit(
        self, owner: Any, fn: Callable[[], Any], done: Callable[[Job], None] | None = None
    ) -> Job:
        """Queue `fn` in `owner`'s lane (from the event loop)."""
        self.loop = asyncio.get_running_loop()
        job = Job(fn, owner, done)
        lane = self._lanes.get(owner)
        if lane is None:
            lane = self._lanes[owner] = _Lane()
        if lane.running < self.per_owner:
            self._start(lane, job)
        else:
            lane.waiting.append(job)
        return job

    async def call(
        self, owner: Any, fn: Callable[[], Any], deadline: float, late: Callable[[Job], None]
    ) -> Job | None:
        """Run `fn` in `owner`'s lane and wait at most `deadline` s: the ended job (its
        `result` or `error`), or None past the deadline or when cancelled; then a job not
        started is dropped, and `late(job)` runs on the loop once it has ended or dropped."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def done(job: Job) -> None:
            if answer.done():
                late(job)
            else:
                job.done = None  # the answer holds the job: no cycle back through this closure
                answer.set_result(job)

        job = self.submit(owner, fn, done)

        def expire() -> None:
            if not answer.done():
                answer.set_result(None)

        timer = loop.call_later(deadline, expire)
        try:
            got = await answer
        except asyncio.CancelledError:
            self.drop(job)
            raise
        finally:
            timer.cancel()
        if got is None:
            self.drop(job)
        return got

    def drop(self, job: Job) -> bool:
        """Take back a job that has not started (its `done` runs, state "dropped")."""
        lane = self._lanes.get(job.owner)
        if job.state != "queued" or lane is None:
            return False
        lane.waiting.remove(job)
        job.state = "dropped"
        self._forget(job.owner, lane)
        self._call_done(job)
        return True

    def backlog(self, owner: Any) -> int:
        """Jobs of `owner` running or waiting."""
        lane = self._lanes.get(owner)
        return 0 if lane is None else lane.running + len(lane.waiting)

    @property
    def busy(self) -> int:
        """Jobs running or waiting, every owner."""
        return sum(lane.running + len(lane.waiting) for lane in self._lanes.values())

    def close(self) -> None:
        """Let the threads go once the jobs queued so far have run (a stuck one stays)."""
        for _ in range(self._started):
            self._queue.put(None)
        self._started = self.spares = 0

    async def idle(self, timeout: float) -> bool:
        """Wait until no job runs or waits (at most `timeout` s); whether that happened."""
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return not self.busy

    def _start(self, lane: _Lane, job: Job) -> None:
        lane.running += 1
        job.state = "running"
        self._running.add(job)
        while self._started < self.threads + self.spares:
            self._spawn()
        self._queue.put(job)
        if not self._watching:
            self._watching = True
            assert self.loop is not None, "set by submit, which starts every job"
            self.loop.call_later(STUCK_AFTER / 2, self._watch)

    def _spawn(self) -> None:
        """Start a thread without waiting for it to run (`Thread.start` would block the
        loop until the scheduler gets to it, for long on a loaded node)."""
        self._started += 1
        _thread.start_new_thread(self._work, ())

    def _ended(self, job: Job) -> None:
        job.state = "ended"
        self._running.discard(job)
        if job.stuck and self.spares:  # its spare may go: one thread leaves at its next turn
            self.spares -= 1
            self._started -= 1
            self._queue.put(None)
        lane = self._lanes[job.owner]
        lane.running -= 1
        while lane.waiting and lane.running < self.per_owner:
            self._start(lane, lane.waiting.popleft())
        self._forget(job.owner, lane)
        self._call_done(job)

    def _forget(self, owner: Any, lane: _Lane) -> None:
        if not lane.running and not lane.waiting:
            del self._lanes[owner]

    def _watch(self) -> None:
        """Give each job running past STUCK_AFTER a spare thread (the others keep theirs)."""
        now = time.monotonic()
        for job in self._running:
            if (
                not job.stuck
                and job.started
                and now - job.started > STUCK_AFTER
                and self.spares < MAX_SPARES
            ):
                job.stuck = True
                self.spares += 1
                self._spawn()
                log.warning(
                    "%s: a job of owner %s has run %.1f s; a spare thread takes its place",
                    self.name,
                    job.owner,
                    now - job.started,
                )
        self._watching = bool(self._running)
        if self._watching:
            assert self.loop is not None, "set by submit, which starts every job"
            self.loop.call_later(STUCK_AFTER / 2, self._watch)

    @staticmethod
    def _call_done(job: Job) -> None:
        if job.done is None:
            return
        try:
            job.done(job)
        except Exception:  # a callback's bug must not break the lanes
            log.exception("lane job callback failed")

    # -- on the threads ----------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.started = time.monotonic()
            try:
                job.result = job.fn()
            except BaseException as exc:  # reported to the loop; the thread goes on
                job.error = exc
            job.ended = time.monotonic()
            assert self.loop is not None, "set by submit, which queued this job"
            with contextlib.suppress(RuntimeError):  # the loop is closed (shutdown): nobody waits
                self.loop.call_soon_threadsafe(self._ended, job)


def close_later(lanes: Lanes | None, owner: Any, close: Callable[[], Any]) -> None:
    """Run `close` (of a lent or received fd, a mapping, a connection) on `owner`'s lane,
    never on the loop; inline only where no loop runs (tools, unit tests)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        lanes = None
    if lanes is None:
        close()
        return
    lanes.submit(owner, close, _log_close_error)


def _log_close_error(job: Job) -> None:
    if job.error is not None:
        log.warning("closing a lent descriptor failed: %s", job.error)
