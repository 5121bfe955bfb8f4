"""Moving pages between engine buffers and host-pool slots.

    store: reserve / pin --> Copier.copy(buf, pages, into_engine, settle) --> commit / unpin
                                 |  copy jobs (transports/base.copy_jobs) in the executor
                                 `- settle(ok) on the loop once no job touches the slots

The store decides which slots move and what happens to them after (`settle`); this module
decides where and how the bytes move. A page is a (host address, engine slot) pair.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Callable, Optional

from sidecar.buffers import Buffer
from sidecar.transports.base import INLINE_MAX, CopyFailed, copy_jobs, copy_pages

log = logging.getLogger("kv_sidecar.store")


class Copier:
    """Runs the copies of set/get for every engine buffer."""

    def __init__(self, executor: Executor, parallel: int = 2):
        self.executor = executor
        self.parallel = parallel

    async def copy(self, buf: Buffer, pages: list[tuple[int, int]], into_engine: bool,
                   settle: Callable[[bool], None]) -> bool:
        """Move (host address, slot) pages in the executor, large moves on several threads
        that plan as they copy (`copy_jobs`): the loop only lists the pages. `settle(ok)`
        runs exactly once, on the loop, when no job can touch the slots any more (commit
        or abort, unpin): a cancelled request still waits for every job first. False when
        the engine's memory failed the copy (it shrank): those pages answer false."""
        ok = False
        try:
            ok = await self._run(buf, pages, into_engine)
        finally:
            settle(ok)
        return ok

    async def _run(self, buf: Buffer, pages: list[tuple[int, int]], into_engine: bool) -> bool:
        if not pages:
            return True
        if buf.released:  # released while the request waited (promotion, back-pressure)
            return False
        if self.inline(buf, len(pages)):
            return self.copy_inline(buf, pages, into_engine)
        buf.acquire()
        try:
            loop = asyncio.get_running_loop()
            futs = [loop.run_in_executor(self.executor, job) for job in
                    copy_jobs(buf.mapping, buf.chunks, pages, into_engine, self.parallel)]
            try:
                await asyncio.shield(asyncio.gather(*futs))
            except asyncio.CancelledError:
                await asyncio.wait(futs)
                raise
            except CopyFailed as exc:
                await asyncio.wait(futs)
                log.warning("copy with buffer %s failed: %s", buf.id, exc)
                return False
            return True
        finally:
            buf.release_ref()

    @staticmethod
    def inline(buf: Buffer, pages: int) -> bool:
        """Whether a move of `pages` pages with `buf` runs on the loop (`copy_inline`)."""
        return getattr(buf.mapping, "inline", False) and \
            pages * sum(c.size for c in buf.chunks) <= INLINE_MAX

    def copy_inline(self, buf: Buffer, pages: list[tuple[int, int]], into_engine: bool) -> bool:
        """A small shm move on the loop: a memmove or pread/pwrite of at most INLINE_MAX
        bytes costs less than two thread hand-offs (get of 64 x 4 KiB: 0.5x -> see bench)."""
        try:
            copy_pages(buf.mapping, buf.chunks, pages, into_engine)
        except CopyFailed as exc:
            log.warning("copy with buffer %s failed: %s", buf.id, exc)
            return False
        return True

    def get_inline(self, buf: Buffer, hosts: list[Optional[int]], slots: list[int]) -> list[bool]:
        """A small get copied on the loop straight after its look-up (`hosts`: each key's
        host address, None when absent): no other request runs in between, so no page can
        be evicted under the copy and none needs a pin."""
        ok = self.copy_inline(buf, [(h, s) for h, s in zip(hosts, slots) if h is not None],
                              into_engine=True)
        if ok and None not in hosts:
            return [True] * len(hosts)
        return [ok and h is not None for h in hosts]
