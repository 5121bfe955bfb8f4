"""The store's durable tiers: presence across tiers, write-through / write-back, promotion.

    host pool (L2)  --write-through / write-back-->  file tier (L3) --> 3FS --> Mooncake
          ^                                               |              |         |
          +------------- promote on get / prefetch -------+--------------+---------+

Every tier speaks sidecar/tiers/base.py. Local look-ups run on the event loop; a tier with
`remote_lookup` (Mooncake) is asked once per request for all its keys, in the executor.

Promotions read their pages on per-owner lanes (`reads`, sidecar/lanes.py), keyed by the
pool's owner: one owner's queue of reads (a tenant's warm jobs) runs on at most half the
read threads, so another owner's promotion starts its read at once rather than behind that
queue (a FIFO executor served every owner's reads in order: a tenant's warm jobs made
another's promotions 20-25x slower). With every thread busy (three owners or more), a
newcomer's read waits for the batches already handed to the threads (half the threads'
worth an owner at most), never for another owner's queue.

A delete sticks (`deleting` -> pool deletes -> `delete`): from the moment it begins until
its tier delete has ended, the deleted keys are marked per (pool, key); no promotion
reserves a marked key, and a load whose tier copy was read before the delete (or while it
ran) commits none of them. Otherwise a warm racing an evict found the tier files the delete
had not removed yet and brought the evicted pages back into the host pool.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor

from pools import HostPool, PagePool
from pools.page_pool import BUSY, PRESENT, Entry, run_in_any
from sidecar.lanes import Job, Lanes
from sidecar.tiers.base import Tier
from sidecar.tiers.writer import TierWriter

DIRTY_CHUNK = 4096  # pages a write-back flush checks in one loop turn


class Tiering:
    """Tiers in lookup order, the write policy, and the writer shared by all namespaces."""

    def __init__(
        self,
        tiers: list[Tier],
        policy: str,
        writer: TierWriter | None,
        host_pool: HostPool,
        executor: Executor,
        read_threads: int = 4,
    ):
        self.tiers = tiers
        self.policy = policy if tiers else "none"
        self.writer = writer
        self.host_pool = host_pool
        self.executor = executor
        self.read_parallel = 2
        self.writing: dict[str, int] = {}  # pages pinned for the writer, per pool
        self.dropping: dict[str, asyncio.Future] = {}  # identities whose tier pages go now
        self.room_wait = 5.0  # seconds a promotion waits for the writer to free slots
        self.room_waits = 0  # promotions that waited so (a counter for /v1/stats)
        self.loading: dict[tuple[str, str], asyncio.Future] = {}  # (pool, key) being promoted
        # tier reads of promotions, per owner: as many threads as the shared executor had
        # (`read_threads`: the copy threads), at most half of them for one owner, as the
        # copy lanes (a promotion's `read_parallel` parts together): the other half is
        # always there for the others, and one owner's reads take at most half the cores
        # (with 4 reads of 8 MiB at once on 2 cores, another's single page took 5.8x longer)
        threads = max(2 * self.read_parallel, read_threads)
        self.reads = Lanes("kv-tier-read", threads, max(self.read_parallel, threads // 2))
        self.being_deleted: dict[tuple[str, str], int] = {}  # (pool, key): deletes under way
        self._undone: dict[asyncio.Future, set[str]] = {}  # a load's keys a delete began on

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    @property
    def queue(self) -> TierWriter:
        """The writer, on the paths only a write policy (or a page it pinned) leads to: a
        policy needs tiers, and tiers come with a writer (`Context`)."""
        assert self.writer is not None, "a write policy without a tier writer"
        return self.writer

    async def locate(self, identity: str, keys: list[str]) -> list[Tier | None]:
        """The first tier (in lookup order) holding each key, or None."""
        where: list[Tier | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for tier in self.tiers:
            if not todo:
                break
            found = await self._lookup(tier, identity, [keys[i] for i in todo])
            for i, hit in zip(todo, found, strict=True):
                if hit:
                    where[i] = tier
            todo = [i for i, hit in zip(todo, found, strict=True) if not hit]
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
                index, asked = tier.index(identity), [keys[i] for i in todo]
                hits = (
                    tier.lookup(identity, asked)
                    if index is None
                    else map(index.__contains__, asked)
                )
                for i, hit in zip(todo, hits, strict=True):
                    found[i] = bool(hit)
        return found

    def local_prefix(self, identity: str, keys: list[str], ready) -> int:
        """Length of the leading run of keys in `ready` (the host pool) or a local tier:
        in C when every local tier lends its index (`Tier.index`), else key by key up to
        the first miss (a request may ask 64 pools of 4,096 keys each: 147 ms of loop
        walked key by key in Python, a file tier's pages only)."""
        local = [t for t in self.tiers if not t.remote_lookup]
        indexes = [i for i in (t.index(identity) for t in local) if i is not None]
        if len(indexes) == len(local):  # every local tier lends its index
            return run_in_any(keys, [ready, *indexes])
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
                for i, hit in zip(
                    todo, await self._lookup(tier, identity, [keys[i] for i in todo]), strict=True
                ):
                    found[i] = hit
        n = 0
        for k, hit in zip(keys, found, strict=True):
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

    # -- writes ---------------------------------------------------------------------
    # write_through: a set takes credits for the pages it will copy (`admit`), waiting
    # while the writer or its pool is crowded; once its copy ends, `queue_committed` pins
    # and queues each committed page in the same loop turn as its commit, so no page
    # answered true can be evicted before it is on the writer's queue.
    #
    #   set: reserve --> admit(n) --(wait for room)--> copy --> commit + queue_committed
    #                                                          \--> release(unused credits)
    def writes(self) -> bool:
        return self.policy == "write_through"

    async def admit(self, identity: str, pool: PagePool, n: int) -> int:
        """Take `n` write credits for `pool` (write_through), waiting while the writer or
        the pool is crowded: at most half of a pool's pages are pinned or promised for
        writing, and at most the writer's `max_pages` in all (a request larger than either
        goes alone). A namespace created again while its old pages go waits for that
        first. Returns the credits taken (0 without write_through)."""
        if not self.writes() or n <= 0:
            return 0
        if identity in self.dropping:
            await asyncio.shield(self.dropping[identity])
        while self._crowded(pool, n):
            await self.queue.wait_change()
        self.writing[pool.name] = self.writing.get(pool.name, 0) + n
        self.queue.promised += n
        return n

    def queue_committed(
        self, identity: str, pool: PagePool, entries: list[Entry], credits: int
    ) -> list:
        """Pin and queue committed pages now (no await: none can be evicted first), each on
        one of `credits` taken by `admit`; the rest of the credits go back. Futures say
        which pages became durable."""
        assert len(entries) <= credits, "more pages than write credits"
        self.writing[pool.name] -= credits  # each queued page counts again, pinned
        self.queue.promised -= credits
        futures = [self._queue_pinned(identity, pool, e.key) for e in entries]
        if len(entries) < credits:
            self.queue.wake()
        return futures

    def release(self, pool: PagePool, credits: int) -> None:
        """Give back credits that no page will use (aborted copies, a failed request)."""
        if credits:
            self.writing[pool.name] -= credits
            self.queue.promised -= credits
            assert self.writing[pool.name] >= 0 and self.queue.promised >= 0, "credits below zero"
            self.queue.wake()

    async def write_through(self, identity: str, pool: PagePool, entries: list[Entry]) -> list:
        """Queue committed pages that took no credits before (benchmarks, tools): waits for
        room first, so between a commit and this call an await may evict a page. The store
        uses `admit` + `queue_committed` instead."""
        if not self.writes():
            return []
        credits = await self.admit(identity, pool, len(entries))
        entries = [e for e in entries if pool.contains(e.key)]
        return [f for f in self.queue_committed(identity, pool, entries, credits) if f is not None]

    def _crowded(self, pool: PagePool, n: int = 1) -> bool:
        w = self.queue
        busy = self.writing.get(pool.name, 0)
        pool_full = busy and busy + n > max(1, pool.capacity_pages // 2)
        queue_full = (w.pending + w.promised) and w.pending + w.promised + n > w.max_pages
        return bool(pool_full or queue_full)

    async def _room(self, pool: PagePool) -> None:
        """Wait until the writer takes a page and `pool` may pin one more for writing."""
        while self._crowded(pool):
            await self.queue.wait_change()

    def _queue_pinned(self, identity: str, pool: PagePool, key: str):
        """Pin `key` and queue it, counted in `writing` until written; None when absent."""
        pinned = pool.pin(key)
        if pinned is None:
            return None
        view = self.host_pool.view(pinned.offset, pool.page_bytes)
        self.writing[pool.name] = self.writing.get(pool.name, 0) + 1
        return self.queue.enqueue(identity, key, view, lambda p=pinned: self._written(pool, p))

    def write_first(self, identity: str, pool: PagePool, keys: list[str]) -> int:
        """Queue now the pages of `keys` no tier holds and none is writing (operator pins,
        sidecar/controls/core.py), while the writer has room; the rest go as usual. Returns
        how many were queued."""
        if self.writer is None:
            return 0
        n = 0
        for key in keys:
            if self.writer.full:
                break
            if (
                pool.contains(key)
                and not self.writer.queued(identity, key)
                and not self.durable(identity, key)
            ):
                n += self._queue_pinned(identity, pool, key) is not None
        return n

    def _written(self, pool: PagePool, e: Entry) -> None:
        self.writing[pool.name] -= 1
        pool.unpin(e)

    def backlogged(self) -> bool:
        """write_back with a full write queue: evictions wait for the writer."""
        return self.policy == "write_back" and self.queue.full

    async def dirty(self, identity: str, pool: PagePool) -> list[str]:
        """write_back: host pages in no tier yet and not queued (what a restart would lose),
        checked DIRTY_CHUNK keys a loop turn (a flush walks every page of the node: 814 ms
        of loop per million pages in one turn)."""
        if self.policy != "write_back" or pool.closed:
            return []
        keys, out = list(pool.ready), []
        for i in range(0, len(keys), DIRTY_CHUNK):
            if i:
                await asyncio.sleep(0)
                if pool.closed:
                    return []
            out += [
                k
                for k in keys[i : i + DIRTY_CHUNK]
                if k in pool.ready
                and not self.queue.queued(identity, k)
                and not self.durable(identity, k)
            ]
        return out

    async def write_dirty(self, identity: str, pool: PagePool, deadline: float) -> int:
        """write_back: queue every dirty page (pinned: each comes back on the LRU as the
        newest once written, so clean pages are evicted before them) until the loop time
        `deadline`; return how many could not be queued in time."""
        if identity in self.dropping:
            await asyncio.shield(self.dropping[identity])
        todo = await self.dirty(identity, pool)
        loop = asyncio.get_running_loop()
        for n, key in enumerate(todo):
            if self._crowded(pool):
                try:
                    await asyncio.wait_for(self._room(pool), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    return len(todo) - n
            if pool.closed:
                return 0
            if not self.queue.queued(identity, key):
                self._queue_pinned(identity, pool, key)
        return 0

    def on_evict(self, identity: str):
        """For write_back: a page in no tier may leave the host pool only once a staged
        copy of it is queued; with the queue full the pool keeps it (and evicts another)."""

        def evicted(pool: PagePool, e: Entry) -> bool:
            if self.queue.queued(identity, e.key) or self.durable(identity, e.key):
                return True
            if identity in self.dropping:  # written now, it would be dropped: keep it
                return False
            page = bytes(self.host_pool.view(e.offset, pool.page_bytes))
            return self.queue.try_submit(identity, e.key, page)

        return evicted

    # -- promotion --------------------------------------------------------------------
    async def promote(self, identity: str, pool: PagePool, keys: list[str]) -> int:
        """Load the keys found only in a tier into the host pool; return how many loaded
        (none once the namespace is gone: its pool is closed). Keys another promotion is
        loading (a warm, a pin restored after a restart) are waited for, not missed."""
        if pool.closed:
            return 0
        keys = [k for k in keys if not pool.contains(k)]
        found = [
            (k, t)
            for k, t in zip(keys, await self.locate(identity, keys) if keys else [], strict=True)
            if t is not None
        ]
        todo = await self._reserve_room(pool, found)
        # (no await from here to `_load` registering this call's keys: two promotions
        # never wait for each other)
        others = {f for k, _ in found if (f := self.loading.get((pool.name, k))) is not None}
        loaded = await self._load(identity, pool, todo) if todo else 0
        if others:
            await asyncio.wait(others)
        return loaded

    async def _load(self, identity: str, pool: PagePool, todo: list) -> int:
        """Read reserved slots [(tier, entry)] from their tiers, on the read lane of the
        pool's owner; commit those read whole, unless a delete of the key began meanwhile
        (`deleting`: the copy read is one the delete removes)."""
        loop = asyncio.get_running_loop()
        mine = loop.create_future()
        for _, r in todo:
            self.loading[(pool.name, r.key)] = mine
        undone = self._undone[mine] = set()
        parts = self._parts(todo)
        futs: list[asyncio.Future] = [loop.create_future() for _ in parts]
        jobs = [
            self.reads.submit(
                pool.owner,
                functools.partial(
                    self._read_all, identity, pool.page_bytes, [todo[i] for i in part]
                ),
                functools.partial(_read_ended, fut),
            )
            for part, fut in zip(parts, futs, strict=True)
        ]
        results, loaded = [False] * len(todo), 0
        try:
            # every part ends before any slot is committed or given back (the reads write
            # into the reserved slots), a part that raised too
            done = await asyncio.shield(asyncio.gather(*futs, return_exceptions=True))
            for part, got in zip(parts, done, strict=True):
                if isinstance(got, BaseException):
                    raise got
                for i, good in zip(part, got, strict=True):
                    results[i] = good
        except asyncio.CancelledError:
            for job in jobs:
                self.reads.drop(job)  # not started: never will (its future ends now)
            await asyncio.wait(futs)  # the reads target reserved slots: let them end first
            raise
        finally:
            del self._undone[mine]
            for (_, r), good in zip(todo, results, strict=True):
                if good and r.key not in undone and (pool.name, r.key) not in self.being_deleted:
                    loaded += pool.commit(r)  # (False: deleted meanwhile, its slot freed)
                else:
                    pool.abort(r)
                if self.loading.get((pool.name, r.key)) is mine:
                    del self.loading[(pool.name, r.key)]
            mine.set_result(None)
        return loaded

    async def _reserve_room(self, pool: PagePool, found: list[tuple[str, Tier]]) -> list:
        """Reserve a slot for each (key, tier) to promote: [(tier, entry)]. With no room
        while the writer holds pages of this pool (pinned for write-through, or kept for
        a full write-back queue), wait for it to write some, up to `room_wait` seconds in
        all: a page answered present is loaded, not missed because a set came just before.

            reserve --no room, writer busy--> wait for a batch --> reserve the rest again
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.room_wait
        todo: list = []
        try:
            while found and not pool.closed:
                later: list[tuple[str, Tier]] = []
                for key, tier in found:
                    if pool.contains(key) or (pool.name, key) in self.being_deleted:
                        continue  # another request loaded it; or it is being deleted
                    # after one "no room", the rest wait too (each failed reserve asks
                    # the host pool for a segment again)
                    r = None if later else pool.reserve(key)
                    if r is None:
                        later.append((key, tier))
                    elif r is not PRESENT and r is not BUSY:
                        todo.append((tier, r))
                left = deadline - loop.time()
                if not later or left <= 0 or not (self.writing.get(pool.name) or self.backlogged()):
                    break
                self.room_waits += 1
                await asyncio.wait_for(self.queue.changed(), left)
                found = later
        except TimeoutError:
            pass
        except BaseException:  # cancelled while waiting: give the slots back
            for _, e in todo:
                pool.abort(e)
            raise
        return todo

    def _parts(self, todo: list) -> list[list[int]]:
        """Indexes of `todo` per read job: local tiers' reads in `read_parallel` slices;
        a remote tier's in one batch (its client spreads the transfers itself, and two
        concurrent batches only compete)."""
        local = [i for i, (tier, _) in enumerate(todo) if not tier.remote_lookup]
        remote = [i for i, (tier, _) in enumerate(todo) if tier.remote_lookup]
        n = min(self.read_parallel, len(local))
        return [local[j::n] for j in range(n)] + ([remote] if remote else [])

    def _read_all(self, identity: str, page_bytes: int, todo: list) -> list[bool]:
        """One `read_batch` per tier for this part of the promotion (on a read lane)."""
        by_tier: dict[Tier, list[int]] = {}
        for i, (tier, _) in enumerate(todo):
            by_tier.setdefault(tier, []).append(i)
        out = [False] * len(todo)
        for tier, idx in by_tier.items():
            items = [
                (todo[i][1].key, self.host_pool.view(todo[i][1].offset, page_bytes)) for i in idx
            ]
            for i, good in zip(idx, tier.read_batch(identity, items), strict=True):
                out[i] = bool(good)
        return out

    def deleting(self, pool: PagePool, keys: list[str]) -> None:
        """A delete of `keys` from `pool` begins (`Store.delete`, before its pool deletes):
        until its `delete(identity, keys, pool)` has ended, no promotion reserves them, and
        a load in flight commits none of them (the copy it read is being deleted)."""
        if not self.tiers:
            return
        for key in keys:
            pk = (pool.name, key)
            self.being_deleted[pk] = self.being_deleted.get(pk, 0) + 1
            loading = self.loading.get(pk)
            if loading is not None and loading in self._undone:
                self._undone[loading].add(key)

    def _deleted(self, pool: PagePool, keys: list[str]) -> None:
        for key in keys:
            pk = (pool.name, key)
            left = self.being_deleted.get(pk, 0) - 1
            if left > 0:
                self.being_deleted[pk] = left
            else:
                self.being_deleted.pop(pk, None)

    async def delete(self, identity: str, keys: list[str], pool: PagePool | None = None) -> int:
        """Remove keys from every tier after cancelling their queued writes and waiting for
        the running ones (none publishes after this); return the keys some tier still holds
        (a delete the tier could not perform: a read-only or failing disk). With `pool`,
        ends the marks `deleting(pool, keys)` set, once every tier has deleted."""
        if not self.tiers:
            return 0
        # shielded: a caller that goes away must not leave a write to publish after it
        task = asyncio.ensure_future(self._delete(identity, keys))
        if pool is not None:
            task.add_done_callback(lambda _: self._deleted(pool, keys))
        return await asyncio.shield(task)

    async def _delete(self, identity: str, keys: list[str]) -> int:
        await self._settle(identity, keys)
        loop = asyncio.get_running_loop()
        for tier in self.tiers:
            await loop.run_in_executor(self.executor, tier.delete, identity, keys)
        return sum(any(t.contains(identity, k) for t in self.tiers) for k in keys)

    async def drop(self, identity: str) -> int:
        """Remove every page of one identity from every tier (a deleted namespace), after
        its writes settle; return the pages some tier could not remove."""
        if not self.tiers:
            return 0
        task = self.dropping.get(identity)
        if task is None:
            task = self.dropping[identity] = asyncio.ensure_future(self._drop(identity))
            task.add_done_callback(lambda _: self.dropping.pop(identity, None))
        return await asyncio.shield(task)

    async def _drop(self, identity: str) -> int:
        await self._settle(identity, None)
        loop = asyncio.get_running_loop()
        for tier in self.tiers:
            await loop.run_in_executor(self.executor, tier.drop, identity)
        return sum(t.count(identity) for t in self.tiers)

    async def _settle(self, identity: str, keys) -> None:
        if self.writer is not None:
            running = self.writer.cancel(identity, keys)
            if running:
                await asyncio.gather(*running)

    def counts(self, identity: str) -> dict[str, int]:
        return {t.name: t.count(identity) for t in self.tiers}

    async def close_reads(self, timeout: float) -> bool:
        """At shutdown, before the tiers close: wait (at most `timeout` s) for the reads
        running or queued, then let the read threads go. Whether every read ended."""
        idle = await self.reads.idle(timeout)
        self.reads.close()
        return idle


def _read_ended(fut: asyncio.Future, job: Job) -> None:
    """A read job ended (its result or error) or was dropped before it started (none read)."""
    if fut.done():
        return
    if job.state == "dropped":
        fut.set_result([])
    elif job.error is not None:
        fut.set_exception(job.error)
    else:
        fut.set_result(job.result)
