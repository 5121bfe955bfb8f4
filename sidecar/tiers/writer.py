"""The write-behind queue: pages waiting to be written to the durable tiers.

    loop: submit / try_submit --> queue.Queue --> writer threads: write_batch per tier
          cancel(identity, keys) marks queued jobs;      (a cancelled job is skipped)
          in_flight(...) -> futures of started jobs  <-- _finish on the loop (unpin, future)

Jobs are queued from the event loop (`submit` waits while `max_pages` are in flight:
back-pressure on the engine; `try_submit` answers False instead), written by worker
threads in batches (one directory fsync per batch), and finished back on the loop.
A delete cancels the jobs of its keys still queued and waits for those a thread already
took (`in_flight`), so no write publishes a page after its delete.

The writer threads yield the CPU to the engines beside the sidecar (`yield_cpu`: nice 19,
the lowest best-effort I/O priority): where engines want every core, the tier's writes get
what the kernel gives a nice-19 thread (about 1.5% of a core an engine thread contends),
never an engine's share. Back-pressure then reaches `set` (write_through waits for
credits), never the engine's step: the vLLM connector skips a save rather than wait
(docs/performance.md, "The store off the critical path").
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import platform
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.tiers.base import Tier

log = logging.getLogger("kv_sidecar.tiers")

BATCH = 64
WRITER_NICE = 19
# ioprio_set(2): IOPRIO_WHO_PROCESS (a thread id), best-effort class 2, level 7 (the lowest)
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(platform.machine())
_IOPRIO_LOWEST = (2 << 13) | 7


def yield_cpu() -> None:
    """Lower the calling thread's CPU and I/O priority (Linux: both are per thread);
    best effort: a kernel that refuses leaves the thread as it was."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
    if _IOPRIO_SET is not None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).syscall(_IOPRIO_SET, 1, tid, _IOPRIO_LOWEST)


@dataclass(slots=True, eq=False)
class WriteJob:
    identity: str
    key: str
    page: Any  # memoryview of a pinned slot, or a staged copy
    seq: int
    future: asyncio.Future
    release: Callable[[], None] | None = field(default=None)
    started: bool = False  # a thread took it (under TierWriter._lock)
    cancelled: bool = False  # deleted before a thread took it


class TierWriter:
    """Writes every queued page to every tier; `flush` waits for what was queued before it.

    `failed` counts pages a tier refused (I/O errors); `dropped` pages that could not be
    queued and were lost (none since evictions wait for room: kept for the metric)."""

    def __init__(self, tiers: list[Tier], threads: int = 2, max_pages: int = 1024):
        self.tiers = tiers
        self.max_pages = max_pages
        self.failed = 0
        self.dropped = 0
        self.cancelled = 0
        self.promised = 0  # write_through credits: pages being copied that will be queued
        self._threads = [
            threading.Thread(target=self._work, name=f"kv-tier-{i}", daemon=True)
            for i in range(threads)
        ]
        self._q: queue.Queue = queue.Queue()
        self._seq = 0
        self._outstanding: dict[int, WriteJob] = {}
        self._by_key: dict[tuple[str, str], list[WriteJob]] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[asyncio.Future] = []  # woken when a batch finishes

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for t in self._threads:
            t.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop `start` ran on; every caller runs after it."""
        assert self._loop is not None, "used before start"
        return self._loop

    @property
    def pending(self) -> int:
        return len(self._outstanding)

    @property
    def full(self) -> bool:
        return len(self._outstanding) + self.promised >= self.max_pages

    def queued(self, identity: str, key: str) -> bool:
        """A write of this page is queued or running."""
        return (identity, key) in self._by_key

    async def submit(self, identity: str, key: str, page, release=None) -> asyncio.Future:
        """Queue one page, waiting while the queue is full; the future tells if it is durable."""
        while self.full:
            await self.changed()
        return self.enqueue(identity, key, page, release)

    def try_submit(self, identity: str, key: str, page) -> bool:
        """Queue a staged copy without waiting (write-back on eviction); False when full:
        the caller keeps the page."""
        if self.full:
            return False
        self.enqueue(identity, key, page, None)
        return True

    def enqueue(self, identity, key, page, release) -> asyncio.Future:
        """Queue one page now (the caller checked `full`)."""
        self._seq += 1
        job = WriteJob(identity, key, page, self._seq, self.loop.create_future(), release)
        self._outstanding[job.seq] = job
        self._by_key.setdefault((identity, key), []).append(job)
        self._q.put(job)
        return job.future

    # -- deletes ----------------------------------------------------------------------
    def cancel(self, identity: str, keys: Iterable[str] | None = None) -> list[asyncio.Future]:
        """Cancel the queued writes of `keys` (None: every key of `identity`); return the
        futures of those a thread already runs (await them before deleting the files)."""
        if keys is None:
            jobs = [j for (ident, _), js in self._by_key.items() if ident == identity for j in js]
        else:
            jobs = [j for k in keys for j in self._by_key.get((identity, k), ())]
        running = []
        with self._lock:
            for job in jobs:
                if job.started:
                    running.append(job.future)
                else:
                    job.cancelled = True
        return running

    # -- workers ----------------------------------------------------------------------
    async def wait_change(self) -> None:
        """Return after the next batch of writes finishes."""
        await self.changed()

    def changed(self) -> asyncio.Future:
        """A future done when the next batch finishes, registered now: a batch that ends
        before the caller awaits it still wakes it (an Event cleared by a waiter that a
        task started late could lose that wake-up and hold a flush to its timeout)."""
        fut = self.loop.create_future()
        self._waiters.append(fut)
        return fut

    def _take(self) -> list[WriteJob] | None:
        """The next batch (cancelled jobs included, marked), or None at the stop mark."""
        job = self._q.get()
        if job is None:
            return None
        batch = [job]
        while len(batch) < BATCH:
            try:
                nxt = self._q.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._q.put(None)  # leave the stop mark for this thread's next get
                break
            batch.append(nxt)
        with self._lock:
            for j in batch:
                j.started = not j.cancelled
        return batch

    def _work(self) -> None:
        yield_cpu()
        while (batch := self._take()) is not None:
            live = [j for j in batch if j.started]
            ok = [True] * len(live)
            for tier in self.tiers:
                if not live:
                    break
                res = tier.write_batch([(j.identity, j.key, j.page) for j in live])
                if len(res) != len(live):  # a tier off its contract fails the batch, not the thread
                    log.error(
                        "tier %s answered %d results for %d pages", tier.name, len(res), len(live)
                    )
                    res = [False] * len(live)
                ok = [a and b for a, b in zip(ok, res, strict=True)]
            good = {id(j): g for j, g in zip(live, ok, strict=True)}
            self.loop.call_soon_threadsafe(self._finish, batch, good)

    def _finish(self, batch: list[WriteJob], good: dict[int, bool]) -> None:
        for job in batch:
            if job.release is not None:
                job.release()
            del self._outstanding[job.seq]
            same = self._by_key[(job.identity, job.key)]
            same.remove(job)
            if not same:
                del self._by_key[(job.identity, job.key)]
            ok = good.get(id(job), False)
            self.failed += not (ok or job.cancelled)
            self.cancelled += job.cancelled
            if not job.future.done():
                job.future.set_result(ok)
        self.wake()

    def wake(self) -> None:
        """Wake every `changed()` waiter (a batch finished, or credits came back)."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():  # (a waiter that timed out is cancelled)
                fut.set_result(None)

    async def flush(self, timeout: float) -> int:
        """Wait until every page queued before the call is written; return those still pending."""
        target = self._seq
        deadline = self.loop.time() + timeout
        while any(s <= target for s in self._outstanding):
            left = deadline - self.loop.time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self.changed(), left)
            except TimeoutError:
                break
        return sum(1 for s in self._outstanding if s <= target)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the workers, waiting at most `timeout` seconds in all (a hung disk)."""
        for _ in self._threads:  # one stop mark per worker
            self._q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
