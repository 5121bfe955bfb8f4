"""The store's durable tiers: presence across tiers, write-through / write-back, promotion.

    host pool (L2)  --write-through / write-back-->  file tier (L3)  -->  3FS tier (shared)
          ^                                               |                   |
          +------------- promote on get / prefetch -------+-------------------+
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Optional

from pools import HostPool, PagePool
from pools.page_pool import BUSY, PRESENT, Entry
from sidecar.tiers.file_tier import FileTier
from sidecar.tiers.writer import TierWriter


class Tiering:
    """Tiers in lookup order, the write policy, and the writer shared by all namespaces."""

    def __init__(self, tiers: list[FileTier], policy: str, writer: Optional[TierWriter],
                 host_pool: HostPool, executor: Executor):
        self.tiers = tiers
        self.policy = policy if tiers else "none"
        self.writer = writer
        self.host_pool = host_pool
        self.executor = executor
        self.read_parallel = 2
        self.writing: dict[str, int] = {}   # pages pinned for the writer, per pool

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def locate(self, identity: str, key: str) -> Optional[FileTier]:
        for tier in self.tiers:
            if tier.contains(identity, key):
                return tier
        return None

    def present(self, identity: str, key: str) -> bool:
        return self.locate(identity, key) is not None

    def durable(self, identity: str, key: str) -> bool:
        return all(t.contains(identity, key) for t in self.tiers)

    # -- writes -----------------------------------------------------------------------
    async def write_through(self, identity: str, pool: PagePool, entries: list[Entry]) -> list:
        """Queue committed pages (pinned until written); futures say which became durable.

        Back-pressure per namespace: at most half of a pool's pages are pinned for writing,
        so a slow disk slows `set` down instead of filling the pool with unevictable pages."""
        if self.policy != "write_through":
            return []
        futures = []
        for e in entries:
            while self.writing.get(pool.name, 0) >= max(1, pool.capacity_pages // 2):
                await self.writer.wait_change()
            pinned = pool.pin(e.key)
            if pinned is None:   # deleted meanwhile
                continue
            view = self.host_pool.view(pinned.offset, pool.page_bytes)
            self.writing[pool.name] = self.writing.get(pool.name, 0) + 1
            futures.append(await self.writer.submit(identity, e.key, view,
                                                    lambda p=pinned: self._written(pool, p)))
        return futures

    def _written(self, pool: PagePool, e: Entry) -> None:
        self.writing[pool.name] -= 1
        pool.unpin(e)

    def on_evict(self, identity: str):
        """For write_back: stage an evicted page's bytes and queue them (never blocks)."""
        def evicted(pool: PagePool, e: Entry) -> None:
            if not self.durable(identity, e.key):
                self.writer.submit_nowait(identity, e.key, bytes(self.host_pool.view(e.offset, pool.page_bytes)))
        return evicted

    # -- promotion --------------------------------------------------------------------
    async def promote(self, identity: str, pool: PagePool, keys: list[str]) -> int:
        """Load the keys found only in a tier into the host pool; return how many loaded
        (none once the namespace is gone: its pool is closed)."""
        if pool.closed:
            return 0
        todo = []
        for key in keys:
            if pool.contains(key):
                continue
            tier = self.locate(identity, key)
            if tier is None:
                continue
            r = pool.reserve(key)
            if r is None or r is PRESENT or r is BUSY:
                continue
            todo.append((tier, r))
        if not todo:
            return 0
        loop = asyncio.get_running_loop()
        parts = [todo[i::self.read_parallel] for i in range(min(self.read_parallel, len(todo)))]
        futs = [loop.run_in_executor(self.executor, self._read_all, identity, pool.page_bytes, p)
                for p in parts]
        results = [False] * len(todo)
        try:
            done = await asyncio.shield(asyncio.gather(*futs))
            results = [None] * len(todo)
            for i, part in enumerate(done):
                results[i::len(parts)] = part
        except asyncio.CancelledError:
            await asyncio.wait(futs)  # the reads target reserved slots: let them end first
            raise
        finally:
            for (_, r), good in zip(todo, results):
                if good:
                    pool.commit(r)
                else:
                    pool.abort(r)
        return sum(results)

    def _read_all(self, identity: str, page_bytes: int, todo: list) -> list[bool]:
        return [tier.read(identity, r.key, self.host_pool.view(r.offset, page_bytes))
                for tier, r in todo]

    async def delete(self, identity: str, keys: list[str]) -> None:
        if self.tiers:
            loop = asyncio.get_running_loop()
            for tier in self.tiers:
                await loop.run_in_executor(self.executor, tier.delete, identity, keys)

    async def drop(self, identity: str) -> None:
        loop = asyncio.get_running_loop()
        for tier in self.tiers:
            await loop.run_in_executor(self.executor, tier.drop, identity)

    def counts(self, identity: str) -> dict[str, int]:
        return {t.name: t.count(identity) for t in self.tiers}
