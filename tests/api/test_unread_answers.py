"""Answers nobody reads (issue 52, items 2 and 4): an inline page answer streams from its
pinned slot, charged to the owner's ledger, so it holds one piece of memory and a slot of
its owner's share, never a copy of the page; and an owner that keeps answers (or gets) in
flight on every segment it took while alone leaves a newcomer its share.

Before: each `GET .../pages/{key}` answer was a fresh copy of the page, made on the event
loop and held for `--write-timeout`: 200 unread 4 MiB answers on the engine socket grew
RSS by 803 MiB and held /healthz up to 1.7 s.
"""

from __future__ import annotations

import http.client
import socket
import time

from loadtest.kit.unix_http import UnixHTTPConnection
from loadtest.redteam.roles import unread
from tests.conftest import wait_for

MIB = 2**20


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _healthz_ms(srv) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", srv.config.port, timeout=10)
    t0 = time.perf_counter()
    conn.request("GET", "/healthz")
    conn.getresponse().read()
    conn.close()
    return (time.perf_counter() - t0) * 1e3


def test_two_hundred_unread_answers_hold_no_copies_and_never_the_loop(make_server):
    srv = make_server(host_pool=256 * MIB, segment_size=4 * MIB)
    c = srv.client()
    c.put_namespace("kv", 4 * MIB)
    c.put_page("kv", "big", b"\x5a" * (4 * MIB))
    wait_for(lambda: srv.on_loop(srv.ctx.monitor.reset) < 1.0)
    before = _rss()
    socks = unread(socket.AF_UNIX, srv.config.socket, "/v1/namespaces/kv/pages/big", 200)
    probes = sorted(_healthz_ms(srv) for _ in range(20))
    ledger = srv.ctx.store.ledger
    wait_for(lambda: srv.on_loop(lambda: ledger.describe()["held_segments"]) == 1)
    grown = (_rss() - before) / MIB
    longest = srv.on_loop(srv.ctx.monitor.reset)
    # a reader still gets the whole page, byte for byte
    conn = UnixHTTPConnection(srv.config.socket, 10)
    conn.request("GET", "/v1/namespaces/kv/pages/big")
    assert conn.getresponse().read() == b"\x5a" * (4 * MIB)
    conn.close()
    for s in socks:
        s.close()
    wait_for(lambda: srv.on_loop(lambda: ledger.describe()["held_segments"]) == 0)
    assert srv.on_loop(lambda: srv.ns("kv").pool.entries["big"].pins) == 0
    srv.invariants()
    srv.on_loop(ledger.invariants)
    print(
        f"200 unread 4 MiB answers: RSS +{grown:.1f} MiB, longest loop turn "
        f"{longest * 1e3:.0f} ms, /healthz median {probes[10]:.1f} ms (this process)"
    )
    assert grown < 64, grown  # before: +803 MiB
    # the loop's own monitor: the server shares this process (and its GIL) with the probes,
    # so their latency is not the server's; loadtest.redteam.runner times /healthz from outside
    assert longest < 0.05, longest


def test_an_owner_holding_answers_everywhere_leaves_a_newcomer_its_share(make_server):
    """The engine socket's uid fills the pool alone and keeps an unread answer on a page of
    every segment, opening new ones as old ones end; anonymous TCP comes: past the
    answers' write timeout the first owner holds at most half the segments (new answers
    past it are 429) and the newcomer stores into the other half."""
    srv = make_server(host_pool=16 * MIB, segment_size=MIB, write_timeout=2.0)
    c = srv.client()
    c.put_namespace("kv", MIB)
    for i in range(16):  # 16 segments of one page each: the whole pool
        c.put_page("kv", f"k{i}", bytes([i]) * MIB)
    socks = []
    for i in range(16):  # the page of each segment, answers never read
        socks += unread(socket.AF_UNIX, srv.config.socket, f"/v1/namespaces/kv/pages/k{i}", 1)
    ledger, owner = srv.ctx.store.ledger, srv.ns("kv").owner
    wait_for(lambda: srv.on_loop(lambda: ledger.held(owner)) == 16)
    tcp = srv.tcp_client()
    tcp.put_namespace("mine", MIB)  # a second owner: the first one's bound is 8
    assert srv.on_loop(lambda: ledger.bound(owner)) == 8
    stored, refused, last = 0, 0, ""
    deadline = time.monotonic() + 60
    while stored < 8 and time.monotonic() < deadline:
        for i in range(16):  # the first owner keeps asking
            socks += unread(socket.AF_UNIX, srv.config.socket, f"/v1/namespaces/kv/pages/k{i}", 1)
        while len(socks) > 224:  # within a uid's 256 connections; those closed here are
            socks.pop(0).close()  # 14 rounds (2.8 s) old: aborted by the 2 s write timeout
        try:
            tcp.put_page("mine", f"m{stored}", b"m" * MIB)
            stored += 1
        except Exception as exc:  # no room while the old answers hold every segment
            assert getattr(exc, "status", None) in (429, 507), exc
            last = str(exc)
            refused += 1
        time.sleep(0.2)
        assert srv.on_loop(lambda: ledger.held(owner)) <= 16
    assert stored == 8, (stored, refused, last)  # its whole share, 8 segments
    assert srv.on_loop(lambda: ledger.held(owner)) <= 8 + 0  # within its new bound
    assert srv.on_loop(lambda: ledger.refused) > 0
    for s in socks:
        s.close()
    srv.invariants()
