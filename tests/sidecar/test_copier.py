"""Copies and fd work never run on the event loop, and a stuck one costs its owner only
(issue 26, item 4): the copier's deadline and settle contract, and the lanes under it.
Stuck jobs are forced with events (a mapping whose copy waits for the test)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sidecar import lanes as lanes_mod
from sidecar.buffers import Buffer
from sidecar.copier import Copier
from sidecar.lanes import Lanes
from sidecar.transports.base import Chunk, CopyFailed

PAGE = 4096


class HeldMapping:
    """A buffer's memory whose copies wait for `release` (a tenant holding its memfd's lock);
    `threads` records where each copy ran."""

    def __init__(self, fail: bool = False):
        self.addresses, self.sealed = [0], True
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads, self.calls, self.fail = [], 0, fail

    def run_plan(self, plan, into_engine):
        self.calls += 1
        self.threads.append(threading.get_ident())
        self.entered.set()
        assert self.release.wait(30)
        if self.fail:
            raise CopyFailed("the engine's buffer shrank")
        return sum(n for _, _, n in plan)

    def close(self):
        pass


def buffer(mapping, owner=1000) -> Buffer:
    return Buffer(
        "b-1", "kv", "shm", 4 * PAGE, 4, (Chunk(0, PAGE, PAGE),), mapping, owner_uid=owner
    )


class Settle:
    """A settle callback that counts its calls; `called` is set at the first."""

    def __init__(self):
        self.calls, self.called = [], asyncio.Event()

    def __call__(self, ok: bool) -> None:
        self.calls.append(ok)
        self.called.set()


async def wait_event(event: threading.Event) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, 10)


def test_copies_run_on_copy_threads_and_settle_once():
    async def main():
        loop_thread = threading.get_ident()
        copier = Copier(threads=2, parallel=1)
        m = HeldMapping()
        m.release.set()
        settle = Settle()
        ok = await copier.copy(buffer(m), [(0, 0), (PAGE, 1)], True, settle)
        failing = HeldMapping(fail=True)
        failing.release.set()
        failed = Settle()
        bad = await copier.copy(buffer(failing), [(0, 0)], False, failed)
        return loop_thread, m.threads, ok, settle.calls, bad, failed.calls

    loop_thread, threads, ok, calls, bad, failed = asyncio.run(main())
    assert threads and loop_thread not in threads
    assert ok is True and calls == [True]
    assert bad is False and failed == [False]


def test_a_copy_past_its_deadline_answers_false_and_settles_when_its_job_ends():
    async def main():
        copier = Copier(threads=2, parallel=1, deadline=0.05)
        m = HeldMapping()
        buf = buffer(m)
        settle = Settle()
        ok = await copier.copy(buf, [(0, 0)], True, settle)
        seen = {"ok": ok, "settled_early": list(settle.calls), "refs": buf.refs, "bad": buf.bad}
        again = Settle()  # a later move with the bad buffer: false at once, no copy
        seen["again"] = await copier.copy(buf, [(0, 1)], True, again)
        seen["again_settled"], seen["calls"] = again.calls, m.calls
        m.release.set()
        await asyncio.wait_for(settle.called.wait(), 10)
        seen["settled"], seen["refs_after"] = settle.calls, buf.refs
        return seen

    seen = asyncio.run(main())
    assert seen["ok"] is False and seen["settled_early"] == [] and seen["refs"] == 1
    assert seen["bad"] and "deadline" in seen["bad"]
    assert seen["again"] is False and seen["again_settled"] == [False] and seen["calls"] == 1
    assert seen["settled"] == [False] and seen["refs_after"] == 0


def test_a_cancelled_copy_settles_when_its_job_ends():
    async def main():
        copier = Copier(threads=2, parallel=1)
        m = HeldMapping()
        settle = Settle()
        task = asyncio.ensure_future(copier.copy(buffer(m), [(0, 0)], False, settle))
        await wait_event(m.entered)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        early = list(settle.calls)
        m.release.set()
        await asyncio.wait_for(settle.called.wait(), 10)
        return early, settle.calls

    early, calls = asyncio.run(main())
    assert early == [] and calls == [False]


def test_one_owners_stuck_copies_leave_threads_to_the_others():
    """Four threads, so one owner runs two jobs at most: its third waits, another owner's
    copy runs meanwhile."""

    async def main():
        copier = Copier(threads=4, parallel=2, deadline=30)
        stuck = [HeldMapping() for _ in range(3)]
        tasks = [
            asyncio.ensure_future(copier.copy(buffer(m, owner=1), [(0, 0)], True, Settle()))
            for m in stuck
        ]
        await wait_event(stuck[0].entered)
        await wait_event(stuck[1].entered)
        other = HeldMapping()
        other.release.set()
        ok = await asyncio.wait_for(
            copier.copy(buffer(other, owner=2), [(0, 0)], True, Settle()), 10
        )
        third_started = stuck[2].entered.is_set()
        for m in stuck:
            m.release.set()
        done = await asyncio.gather(*tasks)
        return ok, third_started, done

    ok, third_started, done = asyncio.run(main())
    assert ok is True and not third_started and done == [True, True, True]


def test_a_stuck_job_gets_a_spare_thread(monkeypatch):
    """One thread: an owner's job stuck past STUCK_AFTER gets a spare started in its place,
    so another owner's job runs; the spare goes once the stuck job ends."""
    monkeypatch.setattr(lanes_mod, "STUCK_AFTER", 0.05)

    async def main():
        lanes = Lanes("t", threads=1, per_owner=1)
        held = threading.Event()
        entered = threading.Event()

        def stuck():
            entered.set()
            assert held.wait(30)

        first_done = asyncio.Event()
        lanes.submit("a", stuck, lambda job: first_done.set())
        await wait_event(entered)
        other = await asyncio.wait_for(lanes.call("b", threading.get_ident, 5, lambda job: None), 5)
        spares = lanes.spares
        held.set()
        await asyncio.wait_for(first_done.wait(), 10)
        return other.result, spares, lanes.spares

    ran_on, spares, after = asyncio.run(main())
    assert ran_on and spares == 1 and after == 0


def test_an_owners_jobs_start_in_order_and_queued_ones_can_be_dropped():
    async def main():
        lanes = Lanes("t", threads=2, per_owner=1)
        order, gate, entered = [], threading.Event(), threading.Event()
        ended, all_ended = [], asyncio.Event()

        def first():
            entered.set()
            assert gate.wait(30)
            order.append(1)

        def end(n):
            def done(job):
                ended.append((n, job.state))
                if len(ended) == 3:
                    all_ended.set()

            return done

        running = lanes.submit("a", first, end(1))
        lanes.submit("a", lambda: order.append(2), end(2))
        queued = lanes.submit("a", lambda: order.append(3), end(3))
        await wait_event(entered)
        dropped_running, dropped_queued = lanes.drop(running), lanes.drop(queued)
        gate.set()
        await asyncio.wait_for(all_ended.wait(), 10)
        return order, ended, lanes.busy, dropped_running, dropped_queued

    order, ended, busy, dropped_running, dropped_queued = asyncio.run(main())
    assert not dropped_running and dropped_queued
    assert order == [1, 2]
    assert ended == [(3, "dropped"), (1, "ended"), (2, "ended")] and busy == 0


def cyclic_garbage(main, kind: type) -> list:
    """The objects of `kind` that running `main()` left for the cyclic GC (it stays off
    meanwhile: what reference counting frees never reaches `gc.garbage`)."""
    import gc

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        asyncio.run(main())
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, kind)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_a_finished_copy_leaves_no_cycle_for_the_gc():
    """A move and its jobs point at each other (a job's `done` is the move's method) until
    the last job ends: then the cycle is cut, and a request's objects (its settle closure,
    its keys, tokens and reservations) go by reference count, not at the next GC pass
    (which took ~15% of a set's CPU when every set's objects waited for it)."""
    from sidecar.copier import _Move

    async def main():
        copier = Copier(threads=2, parallel=2)
        m = HeldMapping()
        m.release.set()
        for _ in range(3):
            assert await copier.copy(buffer(m), [(0, 0), (PAGE, 1), (2 * PAGE, 2)], True, Settle())

    assert cyclic_garbage(main, _Move) == []


def test_a_lane_call_that_ended_leaves_no_cycle_for_the_gc():
    """`Lanes.call`'s answer holds the ended job, whose `done` closure held the answer:
    the closure is let go when it answers (a registration's objects then go at once)."""
    from sidecar.lanes import Job

    async def main():
        lanes = Lanes("t", 2, 1)
        for i in range(3):
            job = await lanes.call(1000, lambda i=i: i, 10, lambda job: None)
            assert job.result == i and job.error is None

    assert cyclic_garbage(main, Job) == []
