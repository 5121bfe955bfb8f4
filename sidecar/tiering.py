"""The store's durable tiers: presence across tiers, write-through / write-back, promotion.

    host pool (L2)  --write-through / write-back-->  file tier (L3) --> 3FS --> Mooncake
          ^                                               |              |         |
          +------------- promote on get / prefetch -------+--------------+---------+

Every tier speaks sidecar/tiers/base.py. Local look-ups run on the event loop; a tier with
`remote_lookup` (Mooncake) is asked once per request for all its keys, in the executor.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Optional

from pools import HostPool, PagePool
from pools.page_pool import BUSY, PRESENT, Entry
from sidecar.tiers.base import Tier
from sidecar.tiers.writer import TierWriter


class Tiering:
    """Tiers in lookup order, the write policy, and the writer shared by all namespaces."""

    def __init__(self, tiers: list[Tier], policy: str, writer: Optional[TierWriter],
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

    async def locate(self, identity: str, keys: list[str]) -> list[Optional[Tier]]:
        """The first tier (in lookup order) holding each key, or None."""
        where: list[Optional[Tier]] = [None] * len(keys)
        todo = list(range(len(keys)))
        for tier in self.tiers:
            if not todo:
                break
            found = await self._lookup(tier, identity, [keys[i] for i in todo])
            for i, hit in zip(todo, found):
                if hit:
                    where[i] = tier
            todo = [i for i, hit in zip(todo, found) if not hit]
        return where

    async def present(self, identity: str, keys: list[str]) -> list[bool]:
        return [t is not None for t in await self.locate(identity, keys)]

    @property
    def remote(self) -> bool:
        """Whether a tier must be asked over the network (in the executor): Mooncake."""
        return any(t.remote_lookup for t in self.tiers)

    def local_present(self, identity: str, keys: list[str]) -> list[bool]:
        """Whether each key is in some local tier (they answer on the event loop)."""
        found = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, hit in enumerate(found) if not hit]
            if not todo:
                break
            if not tier.remote_lookup:
                for i, hit in zip(todo, tier.lookup(identity, [keys[i] for i in todo])):
                    found[i] = bool(hit)
        return found

    def local_prefix(self, identity: str, keys: list[str], ready) -> int:
        """Length of the leading run of keys in `ready` (the host pool) or a local tier,
        walked key by key up to the first miss."""
        local = [t for t in self.tiers if not t.remote_lookup]
        n = 0
        for k in keys:
            if not (k in ready or any(t.contains(identity, k) for t in local)):
                break
            n += 1
        return n

    async def remote_prefix(self, identity: str, keys: list[str], ready) -> int:
        """Length of the leading run of keys found anywhere, for keys whose first one is in
        no local tier: the remote tiers are asked once for all of them."""
        local = [t for t in self.tiers if not t.remote_lookup]
        found = [False] * len(keys)
        for tier in self.tiers:
            if tier.remote_lookup:
                todo = [i for i, hit in enumerate(found) if not hit]
                for i, hit in zip(todo, await self._lookup(tier, identity, [keys[i] for i in todo])):
                    found[i] = hit
        n = 0
        for k, hit in zip(keys, found):
            if not (hit or k in ready or any(t.contains(identity, k) for t in local)):
                break
            n += 1
        return n

    async def prefix(self, identity: str, keys: list[str], ready) -> int:
        """Length of the leading run of keys in `ready` (the host pool) or in some tier.
        Local tiers are walked key by key up to the first miss; remote tiers are then asked
        once for the rest."""
        n = self.local_prefix(identity, keys, ready)
        if n == len(keys) or not self.remote:
            return n
        return n + await self.remote_prefix(identity, keys[n:], ready)

    async def _lookup(self, tier: Tier, identity: str, keys: list[str]) -> list[bool]:
        if not tier.remote_lookup:
            return tier.lookup(identity, keys)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, tier.lookup, identity, keys)

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
        keys = [k for k in keys if not pool.contains(k)]
        todo = []
        for key, tier in zip(keys, await self.locate(identity, keys) if keys else []):
            if tier is None or pool.contains(key):  # (another request may have loaded it)
                continue
            r = pool.reserve(key)
            if r is None or r is PRESENT or r is BUSY:
                continue
            todo.append((tier, r))
        if not todo:
            return 0
        loop = asyncio.get_running_loop()
        parts = self._parts(todo)
        futs = [loop.run_in_executor(self.executor, self._read_all, identity, pool.page_bytes,
                                     [todo[i] for i in part]) for part in parts]
        results = [False] * len(todo)
        try:
            done = await asyncio.shield(asyncio.gather(*futs))
            for part, got in zip(parts, done):
                for i, good in zip(part, got):
                    results[i] = good
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

    def _parts(self, todo: list) -> list[list[int]]:
        """Indexes of `todo` per executor job: local tiers' reads in `read_parallel` slices;
        a remote tier's in one batch (its client spreads the transfers itself, and two
        concurrent batches only compete)."""
        local = [i for i, (tier, _) in enumerate(todo) if not tier.remote_lookup]
        remote = [i for i, (tier, _) in enumerate(todo) if tier.remote_lookup]
        n = min(self.read_parallel, len(local))
        return [local[j::n] for j in range(n)] + ([remote] if remote else [])

    def _read_all(self, identity: str, page_bytes: int, todo: list) -> list[bool]:
        """One `read_batch` per tier for this part of the promotion (in the executor)."""
        by_tier: dict[Tier, list[int]] = {}
        for i, (tier, _) in enumerate(todo):
            by_tier.setdefault(tier, []).append(i)
        out = [False] * len(todo)
        for tier, idx in by_tier.items():
            items = [(todo[i][1].key, self.host_pool.view(todo[i][1].offset, page_bytes)) for i in idx]
            for i, good in zip(idx, tier.read_batch(identity, items)):
                out[i] = bool(good)
        return out

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
