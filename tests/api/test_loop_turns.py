"""No loop turn grows with the data (issue 52, item 6 and its rule): paths whose work grows
with pins or pages run in bounded chunks per turn, measured at a million items by the
sidecar's own loop monitor (sidecar/turns.py, /v1/stats `loop`).

Before: a tenant pinned what its bound allowed of 512-byte pages (~1 M pins); a new owner
(which halves the bound) held /healthz 1.4-2.2 s while the newest pins ended in one turn,
and deleting the namespace 1.7-2.4 s.
"""

from __future__ import annotations

import gc
import time

import pytest

from tests.conftest import wait_for

PAGE = 512
SEG = 8 * 2**20
N = 64 * SEG // PAGE  # 1,048,576 pages: the pin bound of an owner alone in a 1 GiB pool
STEP = 65_536  # items a setup call does on the loop
LIMIT = 0.05  # seconds: the longest loop turn allowed


def _fill(srv, ref: str) -> None:
    ns = srv.ctx.store.namespaces[ref]
    for start in range(0, N, STEP):

        def step(start=start):
            pool = ns.pool
            for i in range(start, start + STEP):
                e = pool.reserve(f"k{i}")
                assert e is not None and pool.commit(e)

        srv.on_loop(step)


def _pin_all(srv, ref: str) -> None:
    ctl, ns = srv.ctx.store.controls, srv.ctx.store.namespaces[ref]
    bound = srv.on_loop(lambda: ctl.bound_segments(ns.owner))
    for start in range(0, N, STEP):

        def step(start=start):
            expires = srv.ctx.loop.time() + 3600
            return sum(
                ctl.hold(ref, ns, f"k{i}", expires, bound) for i in range(start, start + STEP)
            )

        assert srv.on_loop(step) == STEP
    srv.on_loop(lambda: ctl.arm(srv.ctx.loop))


def _longest(srv) -> float:
    return srv.on_loop(srv.ctx.monitor.reset)


@pytest.mark.slow
def test_a_million_pins_end_in_short_turns_when_owners_come_and_the_namespace_goes(make_server):
    srv = make_server(host_pool=2**30, segment_size=SEG)
    c = srv.client(timeout=60)
    c.put_namespace("kv", PAGE)
    ref = next(iter(srv.ctx.store.namespaces))
    _fill(srv, ref)
    _pin_all(srv, ref)
    ctl, ledger = srv.ctx.store.controls, srv.ctx.store.ledger
    owner = srv.ctx.store.namespaces[ref].owner
    assert ctl.live == N and ledger.held(owner) == 64
    gc.collect()
    _longest(srv)
    # a new owner halves the bound: the newest half of the pins end, CHUNK a turn
    srv.tcp_client().put_namespace("other", PAGE)
    wait_for(lambda: ctl.live == N // 2, timeout=120)
    assert srv.on_loop(lambda: ledger.pinned_segments(owner).keys()) == set(range(32))
    assert ctl.released == N // 2
    enforce = _longest(srv)
    # listings and views at half a million pins and a million pages: bounded, not walked
    op = srv.tcp_client()
    assert len(c.request("GET", "/v1/namespaces/kv/pins")[1]["pins"]) == 4096
    for path in ("/v1/pins", "/v1/stats", "/v1/cost", "/metrics", "/v1/namespaces"):
        op.request("GET", path, raw=True)
    views = _longest(srv)
    # the namespace goes with half a million pins: its pins end in chunks after the answer
    t0 = time.monotonic()
    c.delete_namespace("kv")
    answered = time.monotonic() - t0
    wait_for(lambda: ctl.live == 0 and not ctl.ending, timeout=120)
    assert ledger.held(owner) == 0
    drop = _longest(srv)
    srv.invariants()
    srv.on_loop(ledger.invariants)
    print(
        f"longest turns: enforce {enforce * 1e3:.1f} ms, views {views * 1e3:.1f} ms, "
        f"drop {drop * 1e3:.1f} ms "
        f"(delete answered in {answered * 1e3:.0f} ms)"
    )
    assert enforce < LIMIT and views < LIMIT and drop < LIMIT, (enforce, views, drop)
