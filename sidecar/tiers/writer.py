"""The write-behind queue: pages waiting to be written to the durable tiers.

Jobs are queued from the event loop (`submit` waits while `max_pages` are in flight:
back-pressure on the engine), written by worker threads in batches (one directory fsync
per batch), and finished back on the loop (unpin, future, flush bookkeeping).
"""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sidecar.tiers.base import Tier

BATCH = 64


@dataclass(slots=True, eq=False)
class WriteJob:
    identity: str
    key: str
    page: Any                                # memoryview of a pinned slot, or a staged copy
    seq: int
    future: asyncio.Future
    release: Optional[Callable[[], None]] = field(default=None)


class TierWriter:
    """Writes every queued page to every tier; `flush` waits for what was queued before it."""

    def __init__(self, tiers: list[Tier], threads: int = 2, max_pages: int = 1024):
        self.tiers = tiers
        self.max_pages = max_pages
        self.failed = 0
        self.dropped = 0
        self._threads = [threading.Thread(target=self._work, name=f"kv-tier-{i}", daemon=True)
                         for i in range(threads)]
        self._q: queue.Queue = queue.Queue()
        self._seq = 0
        self._outstanding: set[int] = set()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._changed: Optional[asyncio.Event] = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        for t in self._threads:
            t.start()

    @property
    def pending(self) -> int:
        return len(self._outstanding)

    async def submit(self, identity: str, key: str, page, release=None) -> asyncio.Future:
        """Queue one page, waiting while the queue is full; the future tells if it is durable."""
        while len(self._outstanding) >= self.max_pages:
            await self._wait_change()
        return self._enqueue(identity, key, page, release)

    def submit_nowait(self, identity: str, key: str, page) -> bool:
        """Queue a staged copy without waiting (write-back on eviction); False if full."""
        if len(self._outstanding) >= self.max_pages:
            self.dropped += 1
            return False
        self._enqueue(identity, key, page, None)
        return True

    def _enqueue(self, identity, key, page, release) -> asyncio.Future:
        self._seq += 1
        fut = self._loop.create_future()
        self._outstanding.add(self._seq)
        self._q.put(WriteJob(identity, key, page, self._seq, fut, release))
        return fut

    async def wait_change(self) -> None:
        """Return after the next batch of writes finishes."""
        await self._wait_change()

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
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
            ok = [True] * len(batch)
            for tier in self.tiers:
                res = tier.write_batch([(j.identity, j.key, j.page) for j in batch])
                ok = [a and b for a, b in zip(ok, res)]
            self._loop.call_soon_threadsafe(self._finish, batch, ok)

    def _finish(self, batch: list[WriteJob], ok: list[bool]) -> None:
        for job, good in zip(batch, ok):
            if job.release is not None:
                job.release()
            self._outstanding.discard(job.seq)
            self.failed += not good
            if not job.future.done():
                job.future.set_result(good)
        self._changed.set()

    async def flush(self, timeout: float) -> int:
        """Wait until every page queued before the call is written; return those still pending."""
        target = self._seq
        deadline = self._loop.time() + timeout
        while any(s <= target for s in self._outstanding):
            left = deadline - self._loop.time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._wait_change(), left)
            except asyncio.TimeoutError:
                break
        return sum(1 for s in self._outstanding if s <= target)

    def stop(self) -> None:
        for _ in self._threads:  # one stop mark per worker
            self._q.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join(30)
