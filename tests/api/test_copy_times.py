"""Where a restore's time goes (issue 44, "a restore at the copy's speed"): the copier
sums each completed move's hand-off wait, copy and settle, and `/v1/stats` shows the sums
to the operator only (every tenant's copies together)."""

from __future__ import annotations

import asyncio
import time

from api.engine.shm import SharedBuffer, page_first_chunks
from sidecar.copier import Copier
from tests.sidecar.test_copier import HeldMapping, Settle, buffer, wait_event

PAGE = 4096
TOKEN = "copy-times-token"


def test_a_moves_time_is_split_into_wait_copy_and_settle():
    async def main():
        copier = Copier(threads=2, parallel=1)
        m = HeldMapping()
        t0 = time.monotonic()
        task = asyncio.create_task(copier.copy(buffer(m), [(0, 0)], True, Settle()))
        await wait_event(m.entered)
        t1 = time.monotonic()  # its job runs: the wait is over, the copy goes on
        t2 = time.monotonic()
        m.release.set()
        assert await task
        t3 = time.monotonic()
        failing = HeldMapping(fail=True)
        failing.release.set()
        assert not await copier.copy(buffer(failing), [(0, 0)], True, Settle())
        return copier.times, (t0, t1, t2, t3)

    times, (t0, t1, t2, t3) = asyncio.run(main())
    assert times.moves == 1  # the failed move is not counted
    assert 0 <= times.wait_s <= t1 - t0
    assert times.copy_s >= t2 - t1  # the job ran from before t1 to after t2
    assert times.settle_s >= 0 and times.wait_s + times.copy_s + times.settle_s <= t3 - t0


def test_copy_times_are_the_operators_to_see(make_server):
    srv = make_server(token=TOKEN)
    engine = srv.client()
    engine.put_namespace("kv", PAGE)
    buf = SharedBuffer(2 * PAGE)
    try:
        bid = buf.register(engine, "kv", 2, page_first_chunks(PAGE))
        assert engine.set("kv", ["a", "b"], bid, [0, 1]) == [True, True]
        assert engine.get("kv", ["a", "b"], bid, [1, 0]) == [True, True]
        copies = srv.tcp_client().stats()["copies"]
        assert copies["moves"] == 2
        assert copies["copy_s"] > 0 and copies["wait_s"] >= 0 and copies["settle_s"] >= 0
        assert "copies" not in engine.stats()  # a peer: its own namespaces, not the node's copies
        assert "copies" not in make_server().tcp_client().stats()  # anonymous TCP neither
    finally:
        buf.close()
