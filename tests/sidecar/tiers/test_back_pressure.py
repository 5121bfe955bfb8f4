"""Write-through back-pressure (issue 18): a slow tier slows `set` down instead of filling
the pool with unevictable pages. Two bounds, each forced with a tier whose writes wait on
an event (a fault injected on purpose), never with sleeps:

    TierWriter.submit     at most `max_pages` (--write-queue-pages) jobs in flight
    Tiering.write_through at most half of a namespace's pages pinned for writing
"""

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

from pools import Arena, HostPool
from sidecar.tiering import Tiering
from sidecar.tiers.base import Tier
from sidecar.tiers.writer import WRITER_NICE, TierWriter

ID = "0" * 32
PAGE = 4096


class GatedTier(Tier):
    """Accepts every write, but only once `gate` is set; counts the pages it was given."""

    def __init__(self):
        self.name = "gated"
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.written: list[str] = []

    def contains(self, identity, key):
        return key in self.written

    def write_batch(self, jobs):
        self.tid = threading.get_native_id()
        self.entered.set()
        self.gate.wait(60)
        self.written += [key for _, key, _ in jobs]
        return [True] * len(jobs)


def committed(pool, n: int) -> list:
    """Pages k0..k{n-1} stored in `pool`: their entries."""
    entries = [pool.reserve(f"k{i}") for i in range(n)]
    assert all(pool.commit(e) for e in entries)
    return entries


async def blocked(aw, wait: float = 0.3) -> bool:
    """True when `aw` is still waiting after the writer had every chance to accept it
    (a bound that holds lets nothing through until the gate opens, however long)."""
    task = asyncio.ensure_future(aw)
    await asyncio.sleep(wait)
    return not task.done()


def test_submit_waits_while_the_write_queue_is_full():
    async def main():
        tier = GatedTier()
        writer = TierWriter([tier], threads=1, max_pages=4)
        writer.start()
        try:
            futs = [
                await asyncio.wait_for(writer.submit(ID, f"k{i}", b"x" * PAGE), 5) for i in range(4)
            ]
            assert writer.pending == 4
            fifth = asyncio.ensure_future(writer.submit(ID, "k4", b"x" * PAGE))
            assert await blocked(asyncio.shield(fifth)), (
                "a 5th page went past --write-queue-pages 4"
            )
            assert writer.pending == 4
            tier.gate.set()
            assert await asyncio.wait_for(asyncio.gather(*futs), 10) == [True] * 4
            assert await asyncio.wait_for(await asyncio.wait_for(fifth, 10), 10) is True
        finally:
            tier.gate.set()
            writer.stop()

    asyncio.run(main())


def test_write_through_pins_at_most_half_a_namespace():
    async def main():
        arena = Arena(1 << 20)
        host = HostPool(arena, 64 * PAGE)
        pool = host.create("kv", PAGE, capacity_bytes=8 * PAGE)
        tier = GatedTier()
        writer = TierWriter([tier], threads=1, max_pages=1024)  # the queue is not the limit
        writer.start()
        tiering = Tiering([tier], "write_through", writer, host, ThreadPoolExecutor(1))
        try:
            entries = committed(pool, 6)
            assert pool.capacity_pages == 8
            first = await asyncio.wait_for(tiering.write_through(ID, pool, entries[:4]), 5)
            assert len(first) == 4 and tiering.writing["kv"] == 4
            more = tiering.write_through(ID, pool, entries[4:])
            assert await blocked(more), "a 5th page pinned for writing in a pool of 8"
            assert tiering.writing["kv"] == 4 and pool._pinned == 4
        finally:
            tier.gate.set()
            writer.stop()
            arena.close()

    asyncio.run(main())


class _PostedLoop:
    """The writer's loop, with `posted` set once a worker thread has queued `_finish`."""

    def __init__(self, loop):
        self.loop, self.posted = loop, threading.Event()

    def call_soon_threadsafe(self, *args):
        self.loop.call_soon_threadsafe(*args)
        self.posted.set()

    def __getattr__(self, name):
        return getattr(self.loop, name)


def test_flush_wakes_when_the_last_batch_ends_before_it_waits():
    """The order that once held a flush to its timeout: the last batch's `_finish` is
    queued on the loop before the flush's wait starts (the flush checked `_outstanding`
    just before). Forced: the batch ends while the flush's first step is still queued."""

    async def main():
        tier = GatedTier()
        writer = TierWriter([tier], threads=1, max_pages=4)
        writer.start()
        loop = _PostedLoop(writer._loop)
        writer._loop = loop
        await writer.submit(ID, "k", memoryview(bytes(PAGE)))
        assert await asyncio.to_thread(tier.entered.wait, 10)
        flush = asyncio.ensure_future(writer.flush(5.0))  # its first step is queued
        tier.gate.set()
        assert loop.posted.wait(10)  # `_finish` queued after it
        t0 = asyncio.get_running_loop().time()
        assert await flush == 0
        assert asyncio.get_running_loop().time() - t0 < 4.0, "the flush waited for its timeout"
        writer.stop()

    asyncio.run(main())


class HeldTier(GatedTier):
    """A GatedTier that also holds pages to promote (`held`), read as bytes of their key."""

    def __init__(self, held):
        super().__init__()
        self.held = set(held)

    def contains(self, identity, key):
        return key in self.held or key in self.written

    def lookup(self, identity, keys):
        return [self.contains(identity, k) for k in keys]

    def read_batch(self, identity, items):
        for key, dst in items:
            dst[:] = key.encode().ljust(len(dst), b"-")
        return [True] * len(items)


@contextlib.asynccontextmanager
async def _pool_pinned_for_writing(wait: float):
    """A pool of 8 pages, every one pinned for the writer (a set larger than half the pool
    goes alone) behind a closed gate; a tier holding `t0`, `t1` to promote. Yields
    (pool, tier, tiering); opens the gate and stops the writer after."""
    arena = Arena(1 << 20)
    host = HostPool(arena, 64 * PAGE)
    pool = host.create("kv", PAGE, capacity_bytes=8 * PAGE)
    tier = HeldTier(["t0", "t1"])
    writer = TierWriter([tier], threads=1, max_pages=1024)
    writer.start()
    tiering = Tiering([tier], "write_through", writer, host, ThreadPoolExecutor(1))
    tiering.room_wait = wait
    try:
        entries = committed(pool, 8)
        assert len(await asyncio.wait_for(tiering.write_through(ID, pool, entries), 5)) == 8
        assert pool._pinned == 8 and pool.reserve("x") is None  # no slot: all pinned
        yield pool, tier, tiering
    finally:
        tier.gate.set()
        writer.stop()
        arena.close()


def test_a_promotion_waits_for_the_writer_to_free_slots():
    """The CI failure of stop 42 (`failed_loads` 2 in the trace replay): a get right after
    a large set found every slot pinned for writing and answered false for pages `exists`
    had just counted. It now waits for the writer; the pages load once a batch is written."""

    async def main():
        async with _pool_pinned_for_writing(wait=30.0) as (pool, tier, tiering):
            promote = asyncio.ensure_future(tiering.promote(ID, pool, ["t0", "t1"]))
            assert await blocked(asyncio.shield(promote)), "answered before the writer wrote"
            assert tiering.room_waits >= 1
            tier.gate.set()
            assert await asyncio.wait_for(promote, 10) == 2
            assert pool.contains("t0") and pool.contains("t1")
            pool.invariants()

    asyncio.run(main())


def test_a_promotion_gives_up_when_the_writer_stays_stuck():
    """A hung tier holds a get at most `room_wait`: then the pages are misses, the slots
    reserved meanwhile are given back, and the pool's counts hold."""

    async def main():
        async with _pool_pinned_for_writing(wait=0.3) as (pool, tier, tiering):
            assert await asyncio.wait_for(tiering.promote(ID, pool, ["t0", "t1"]), 10) == 0
            assert not pool.contains("t0") and pool._reserved == 0
            pool.invariants()

    asyncio.run(main())


def _write_back_store(tmp_path):
    from sidecar.buffers import Sources
    from sidecar.store import Store
    from sidecar.tiers.file_tier import FileTier

    arena = Arena(4 << 20)
    host = HostPool(arena, 64 << 10)
    tier = FileTier("file", str(tmp_path / "tier"))
    executor = ThreadPoolExecutor(2)
    writer = TierWriter([tier], threads=1, max_pages=64)
    tiering = Tiering([tier], "write_back", writer, host, executor)
    store = Store(host, executor, Sources(["/dev/shm"]), tiering=tiering)
    return arena, store, tier, writer, executor


def test_a_peers_flush_writes_its_own_namespaces_and_the_walk_yields(tmp_path, monkeypatch):
    """write_back: a flush by a peer queues the dirty pages of the namespaces it reaches,
    not the whole node's (any peer may call it; the operator's flush takes every one);
    the dirty pages are checked DIRTY_CHUNK at a time, the loop free between chunks."""
    from sidecar import tiering as tiering_mod
    from sidecar.peer import Peer
    from sidecar.spec import parse_spec

    monkeypatch.setattr(tiering_mod, "DIRTY_CHUNK", 8)
    a, b = Peer(1, 1001, 1001), Peer(2, 1002, 1002)

    async def main():
        arena, store, tier, writer, executor = _write_back_store(tmp_path)
        writer.start()
        try:
            for who in (a, b):
                ns, _ = store.put_namespace("kv", parse_spec({"page_bytes": 512}), who)
                for i in range(40):
                    ns.pool.commit(ns.pool.reserve(f"k{i}"))
            nsa, nsb = (store.namespace(store.resolve("kv", w)) for w in (a, b))
            turns = []

            async def ticker():
                while True:
                    turns.append(1)
                    await asyncio.sleep(0)

            tick = asyncio.ensure_future(ticker())
            await asyncio.sleep(0)
            turns.clear()
            assert len(await store.tiering.dirty(nsa.identity, nsa.pool)) == 40
            tick.cancel()
            assert len(turns) >= 40 // 8 - 1, "the dirty walk held the loop in one turn"
            assert await asyncio.wait_for(store.flush(10, a), 20) == 0
            ida, idb = nsa.identity, nsb.identity
            assert tier.count(ida) == 40 and tier.count(idb) == 0
            assert await asyncio.wait_for(store.flush(10), 20) == 0  # the operator
            assert tier.count(idb) == 40
        finally:
            writer.stop()
            executor.shutdown()
            arena.close()

    asyncio.run(main())


def nice_of(tid: int) -> int:
    """A thread's nice value from /proc (field 19 of its stat)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_the_writer_threads_yield_the_cpu_to_engines():
    """The tier's writes run at nice 19 (what an engine beside the sidecar gives up to them
    is bounded by the kernel's weights), the event loop's thread at its own priority."""

    async def main():
        tier = GatedTier()
        writer = TierWriter([tier], threads=2, max_pages=4)
        writer.start()
        fut = await writer.submit(ID, "k0", b"x" * PAGE)
        assert tier.entered.wait(10)  # a writer thread runs the batch: it has lowered itself
        nice = nice_of(tier.tid)
        tier.gate.set()
        assert await fut is True
        writer.stop()
        return nice

    before = nice_of(threading.get_native_id())
    assert before < WRITER_NICE
    assert asyncio.run(main()) == WRITER_NICE
    assert nice_of(threading.get_native_id()) == before  # only the writer's threads


class ShortTier(GatedTier):
    """Answers one result short for the first batch (off the tier protocol's contract), then
    keeps it."""

    def write_batch(self, jobs):
        first = not self.written
        self.written += [key for _, key, _ in jobs]
        return [True] * (len(jobs) - 1 if first else len(jobs))


def test_a_tier_off_its_contract_fails_the_batch_and_the_writer_goes_on():
    async def main():
        writer = TierWriter([ShortTier()], threads=1)
        writer.start()
        try:
            first = await writer.submit(ID, "a", b"x" * PAGE)
            assert await asyncio.wait_for(first, 10) is False  # counted failed, not dropped
            assert writer.failed == 1
            second = await writer.submit(ID, "b", b"x" * PAGE)
            assert await asyncio.wait_for(second, 10) is True  # the thread lived
        finally:
            writer.stop()

    asyncio.run(main())
