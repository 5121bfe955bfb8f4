"""Issue 52 (sidecar/tiering.py): an evict racing a warm of the same pages sticks, and one
owner's tier reads never queue another owner's promotion behind them. Each race is forced
with events (a file tier whose reads or deletes wait on one: a fault injected on purpose),
never with sleeps.

    evict:  deleting (marks) -> pool deletes -> tier delete ---------> marks end
    warm:     locate -> reserve (skips a marked key) -> read -> commit (none marked or
                                                                doomed meanwhile)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor

from pools import Arena, HostPool
from sidecar.tiering import Tiering
from sidecar.tiers.base import Tier
from tests.conftest import Gate, wait_for

PAGE = 4096
ID_A, ID_B = "a" * 32, "b" * 32


def data(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def post(c, path, body):
    return c.request("POST", path, body)[1]


class HeldReads:
    """Wraps a tier's `read_batch`: each call reads the pages (the tier copy is in the
    slots), then waits until `release` before it answers; `entered` once one waits."""

    def __init__(self, tier):
        self.real = tier.read_batch
        self.entered, self.release = threading.Event(), threading.Event()
        tier.read_batch = self._read

    def _read(self, identity, items):
        got = self.real(identity, items)
        self.entered.set()
        assert self.release.wait(30), "the test never released the reads"
        return got


def tier_only(make_server, tmp_path, keys):
    """A sidecar with a file tier holding `keys` of namespace kv, none in the host pool."""
    srv = make_server(file_tier=True, data_dir=str(tmp_path / "data"))
    wait_for(lambda: srv.ctx.ready)
    c = srv.client(timeout=60)
    c.put_namespace("kv", PAGE)
    for k in keys:
        c.put_page("kv", k, data(k))
    assert c.request("POST", "/v1/flush")[1]["pending"] == 0
    pool = srv.ns("kv").pool
    srv.on_loop(lambda: [pool.delete(k) for k in keys])
    assert c.exists("kv", keys) == len(keys)  # in the file tier only
    return srv, c


def gone_everywhere(srv, c, keys) -> None:
    """No key is in the host pool or a tier; exists and a get (which promotes) miss."""
    pool, tiering, ident = srv.ns("kv").pool, srv.ctx.tiering, srv.ns("kv").identity
    assert srv.on_loop(lambda: [k for k in keys if pool.contains(k)]) == []
    assert srv.on_loop(lambda: [k for k in keys if tiering.local_present(ident, [k])[0]]) == []
    assert c.exists("kv", keys) == 0 and c.exists_each("kv", keys) == [False] * len(keys)
    assert c.get_page("kv", keys[0]) is None and c.get_page("kv", keys[-1]) is None
    assert srv.on_loop(lambda: tiering.being_deleted) == {}
    srv.invariants()


def test_an_evict_during_a_warms_read_sticks(make_server, tmp_path):
    """The warm's first reads have copied the tier pages into their slots and wait; the
    evict deletes every key from the pool and the tier meanwhile and answers. Released,
    the reads commit nothing, and the warm's later steps find nothing to bring back."""
    keys = [f"w{i}" for i in range(200)]  # 4 warm steps of 64
    srv, c = tier_only(make_server, tmp_path, keys)
    held = HeldReads(srv.ctx.tiering.tiers[0])
    job = post(c, "/v1/namespaces/kv/warm", {"keys": keys})
    assert job["pages"] == 200
    try:
        assert held.entered.wait(10)
        with ThreadPoolExecutor(1) as ex:
            evict = ex.submit(
                post, srv.client(timeout=60), "/v1/namespaces/kv/evict", {"keys": keys}
            )
            # the tier delete does not queue behind the held reads (they run on read lanes)
            assert evict.result(30) == {"deleted": 200, "failed": 0}
    finally:
        held.release.set()
    wait_for(lambda: c.request("GET", f"/v1/warm/{job['job']}")[1]["state"] != "running")
    state = c.request("GET", f"/v1/warm/{job['job']}")[1]
    assert (state["state"], state["loaded"]) == ("done", 0)
    gone_everywhere(srv, c, keys)


def test_a_warm_that_locates_after_the_pool_delete_loads_nothing(make_server, tmp_path):
    """The evict's pool deletes are done and its tier delete is held: a warm (and a get)
    started now still finds the tier files, and must bring none of them back."""
    keys = [f"w{i}" for i in range(130)]
    srv, c = tier_only(make_server, tmp_path, keys)
    gate = Gate(srv.ctx.tiering.tiers[0], "delete")  # the tier delete waits (an executor thread)
    with ThreadPoolExecutor(1) as ex:
        evict = ex.submit(post, srv.client(timeout=60), "/v1/namespaces/kv/evict", {"keys": keys})
        try:
            assert gate.entered.wait(10)
            job = post(c, "/v1/namespaces/kv/warm", {"keys": keys})
            assert job["pages"] == 130  # the tier still holds them
            wait_for(lambda: c.request("GET", f"/v1/warm/{job['job']}")[1]["state"] != "running")
            state = c.request("GET", f"/v1/warm/{job['job']}")[1]
            assert (state["state"], state["loaded"]) == ("done", 0)
            assert c.get_page("kv", keys[5]) is None  # a get's promotion neither
            pool = srv.ns("kv").pool
            assert srv.on_loop(lambda: [k for k in keys if pool.contains(k)]) == []
        finally:
            gate.open()
        assert evict.result(30) == {"deleted": 130, "failed": 0}
    gone_everywhere(srv, c, keys)


# -- per-owner read lanes -----------------------------------------------------------------------
class SlowTier(Tier):
    """Holds every key; reads of identity A wait for `gate` (counted as they start and
    end), reads of B answer at once."""

    def __init__(self):
        self.name = "slow"
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.started = {ID_A: 0, ID_B: 0}
        self.ended = {ID_A: 0, ID_B: 0}
        self.a_waits = threading.Event()

    def contains(self, identity, key):
        return True

    def count(self, identity):
        return 0

    def read_batch(self, identity, items):
        with self.lock:
            self.started[identity] += 1
        if identity == ID_A:
            self.a_waits.set()
            assert self.gate.wait(30), "the test never opened the gate"
        for key, dst in items:
            dst[:] = key.encode().ljust(len(dst), b"-")
        with self.lock:
            self.ended[identity] += 1
        return [True] * len(items)


def _two_owners(read_threads: int):
    arena = Arena(8 << 20)
    host = HostPool(arena, 64 * PAGE)
    pa = host.create("a", PAGE, owner="A")
    pb = host.create("b", PAGE, owner="B")
    tier = SlowTier()
    tiering = Tiering([tier], "none", None, host, ThreadPoolExecutor(4), read_threads)
    return arena, pa, pb, tier, tiering


def test_one_owners_queue_of_tier_reads_never_holds_anothers_promotion():
    """Owner A queues 6 promotions of 8 pages (12 reads, every one held once it starts);
    with A's lane running all it may, B's promotion of one page loads while A's reads are
    still held and queued: B's read started before A's queue drained. (On the shared FIFO
    executor B's read waited behind all 12.)"""

    async def main():
        arena, pa, pb, tier, tiering = _two_owners(8)  # 4 reads an owner, on 8 threads
        try:
            a = [
                asyncio.ensure_future(tiering.promote(ID_A, pa, [f"a{j}-{i}" for i in range(8)]))
                for j in range(6)
            ]
            full = tiering.reads.per_owner  # A's lane runs as many as it may: all held
            await asyncio.to_thread(wait_for, lambda: tier.started[ID_A] == full, 10)
            assert await asyncio.wait_for(tiering.promote(ID_B, pb, ["b0"]), 10) == 1
            assert pb.contains("b0") and tier.started[ID_B] == 1
            assert tier.ended[ID_A] == 0 and not any(t.done() for t in a)  # A's still held
            assert tier.started[ID_A] == full == 4 and tiering.reads.threads == 8
            assert tiering.reads.backlog("A") == 12  # running or waiting in A's lane
            tier.gate.set()
            assert await asyncio.wait_for(asyncio.gather(*a), 10) == [8] * 6
            assert tier.ended[ID_A] == tier.started[ID_A] == 12
            pa.invariants()
            pb.invariants()
        finally:
            tier.gate.set()
            assert await tiering.close_reads(10)
            arena.close()

    asyncio.run(main())


def test_a_cancelled_promotion_waits_for_its_running_reads_and_drops_queued_ones():
    """Its slots are the reads' targets: a cancelled promotion returns only once the reads
    that started have ended; those not started never run; every slot is given back."""

    async def main():
        arena, pa, _, tier, tiering = _two_owners(4)  # 2 reads an owner: 1 promotion
        try:
            first = asyncio.ensure_future(tiering.promote(ID_A, pa, [f"x{i}" for i in range(8)]))
            assert await asyncio.to_thread(tier.a_waits.wait, 10)
            queued = asyncio.ensure_future(tiering.promote(ID_A, pa, [f"y{i}" for i in range(8)]))
            for _ in range(20):  # (loop turns: the second reaches its lane, behind the first)
                await asyncio.sleep(0)
            assert tiering.reads.backlog("A") == 4 and tier.started[ID_A] == 2
            first.cancel()
            queued.cancel()
            for _ in range(20):
                await asyncio.sleep(0)
            assert not first.done(), "it returned while its reads still write into its slots"
            assert tiering.reads.backlog("A") == 2  # the queued promotion's reads dropped
            tier.gate.set()
            for t in (first, queued):
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(t, 10)
            assert tier.started[ID_A] == 2 and pa._reserved == 0 and not pa.contains("x0")
            pa.invariants()
        finally:
            tier.gate.set()
            assert await tiering.close_reads(10)
            arena.close()

    asyncio.run(main())
