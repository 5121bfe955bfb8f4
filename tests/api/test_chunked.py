"""Chunked bodies (issue 52, item 3): the framing of one body (chunk-size lines, extensions,
trailers) shares one head budget, grown by its data, and a body whose chunks are too small
for their data is refused at once (`sidecar/server.py`, CHUNK_MIN_AVG): a flood of page PUTs
in 1-byte chunks on both listeners leaves `/healthz` fast, while chunks of KiBs are stored
as ever. The body grows in place, never by `bytes +=`. Real sockets against live servers (a
process of its own where latency is timed); waits are on events or on the socket being
closed, never on a sleep."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from api.engine.client import SidecarClient
from loadtest.redteam.conn import FLOODS_ENGINE, FLOODS_TCP, refused_chunks, tiny_chunk_round
from sidecar.server import (
    CHUNK_MIN_AVG,
    CHUNKS_AHEAD,
    FRAMING_SHARE,
    PeerHttpProtocol,
    _Cycle,
)
from tests.api.test_bounds import PROBE_LIMIT
from tests.api.test_connections import answer, chunked, closed_by_server
from tests.conftest import engine_connection

PAGE = 4096
BIG = 1 << 20
EXISTS = b"POST /v1/namespaces/kv/exists HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


def put_head(ns: str, key: str) -> bytes:
    return (
        b"PUT /v1/namespaces/%s/pages/%s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        % (ns.encode(), key.encode())
    )


def framed(*pieces: bytes, ext: bytes = b"", trailer: bytes = b"") -> bytes:
    """A chunked body of exactly these chunks (each with extension `ext`), then its end."""
    return (
        b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces)
        + b"0\r\n"
        + trailer
        + b"\r\n"
    )


def json_of(n: int) -> bytes:
    """An exists body of exactly `n` bytes (a key list, then spaces)."""
    body = b'{"keys": []}'
    return body + b" " * (n - len(body))


def refused(s: socket.socket, status: int, code: str) -> bool:
    got, reply = answer(s)
    return (got, reply["error"]["code"]) == (status, code) and closed_by_server(s)


# -- the rule, at its edges (in-process server, engine socket) -----------------------------
def test_a_few_tiny_chunks_pass_and_one_more_is_refused(server, client):
    """Each chunk (the empty last one too) spends CHUNK_MIN_AVG, each data byte earns one,
    from CHUNKS_AHEAD * CHUNK_MIN_AVG: CHUNKS_AHEAD - 1 one-byte chunks fit, one more not."""
    client.put_namespace("kv", PAGE)
    fits = CHUNKS_AHEAD - 1
    s = engine_connection(server)
    s.sendall(EXISTS + chunked(json_of(fits), 1))
    assert answer(s) == (200, {"prefix": 0})
    s.sendall(EXISTS + chunked(json_of(fits + 1), 1))
    assert refused(s, 400, "chunks_too_small")


def test_chunks_of_a_kib_go_on_and_half_that_is_refused(server, client):
    """A 1 MiB page in chunks of CHUNK_MIN_AVG (1,024 of them) is stored; in chunks half as
    big, refused before it is whole (nothing stored)."""
    client.put_namespace("big", BIG)
    page = os.urandom(BIG)
    s = engine_connection(server)
    s.sendall(put_head("big", "avg") + chunked(page, CHUNK_MIN_AVG))
    assert answer(s) == (201, {"stored": True, "created": True})
    assert client.get_page("big", "avg") == page
    s.sendall(put_head("big", "half") + chunked(page, CHUNK_MIN_AVG // 2))
    assert refused(s, 400, "chunks_too_small")
    assert client.exists("big", ["half"]) == 0
    server.invariants()


def test_a_big_chunk_does_not_pay_for_a_run_of_tiny_ones(server, client):
    """Credit is capped at CHUNKS_AHEAD chunks: half a page in one chunk, then 100 one-byte
    chunks (the whole body would average 5 KiB a chunk) is refused at the 65th."""
    client.put_namespace("big", BIG)
    half = b"h" * (BIG // 2)
    tiny = [b"t"] * 100
    rest = b"r" * (BIG - len(half) - len(tiny))
    s = engine_connection(server)
    s.sendall(put_head("big", "banked") + framed(half, *tiny, rest))
    assert refused(s, 400, "chunks_too_small")
    assert client.exists("big", ["banked"]) == 0


def test_the_framing_of_one_body_shares_one_budget(server, client):
    """40 chunks of 1 KiB, each with a 2 KiB extension: 80 KiB of framing for 40 KiB of data,
    past `max_head` + 1/FRAMING_SHARE of the data (each chunk's framing had a budget of its
    own before). The same chunks without the extension are served."""
    client.put_namespace("kv", PAGE)
    body = json_of(40 * 1024)
    pieces = [body[i : i + 1024] for i in range(0, len(body), 1024)]
    ext = b";e=" + b"x" * 2048
    assert 40 * len(ext) > server.config.max_head + len(body) // FRAMING_SHARE
    s = engine_connection(server)
    s.sendall(EXISTS + framed(*pieces))
    assert answer(s) == (200, {"prefix": 0})
    s.sendall(EXISTS + framed(*pieces, ext=ext))
    assert refused(s, 431, "headers_too_large")


def test_a_body_past_the_head_budget_is_not_a_head_but_its_trailer_is(server, client):
    """200 KB in 1 KiB chunks: three times `max_head`, all of it data; a 128 KiB trailer is
    framing, over the budget."""
    client.put_namespace("kv", PAGE)
    body = json_of(200_000)
    assert len(body) > 3 * server.config.max_head
    s = engine_connection(server)
    s.sendall(EXISTS + chunked(body, 1024))
    assert answer(s) == (200, {"prefix": 0})
    s.sendall(EXISTS + chunked(body, 1024, b"X-Trailer: " + b"t" * (128 << 10) + b"\r\n"))
    assert refused(s, 431, "headers_too_large")


# -- the body grows in place, and reaches the app as bytes ----------------------------------
def test_the_body_grows_in_place_with_uvicorns_flow_control():
    """`on_body` extends one bytearray (even from the `b""` an older uvicorn resets it to),
    pauses reading past HIGH_WATER_LIMIT and wakes the app, as uvicorn's does."""
    cycle = SimpleNamespace(body=b"", response_complete=False, message_event=asyncio.Event())
    proto = SimpleNamespace(
        cycle=cycle,
        flow=mock.Mock(),
        _head_left=0,
        _body_left=None,
        _chunk_credit=0,
        _body_in=0,
        loop=SimpleNamespace(time=lambda: 0.0),
    )
    PeerHttpProtocol.on_body(proto, b"a")
    grown = cycle.body
    assert type(grown) is bytearray and cycle.message_event.is_set()
    for _ in range(HIGH_WATER_LIMIT // 1024):
        PeerHttpProtocol.on_body(proto, b"b" * 1024)
        assert cycle.body is grown  # never a new object: no copy of what came before
    assert proto.flow.pause_reading.called
    assert bytes(grown) == b"a" + b"b" * HIGH_WATER_LIMIT
    assert proto._head_left == 1 + HIGH_WATER_LIMIT + (1 + HIGH_WATER_LIMIT) // FRAMING_SHARE
    assert proto._chunk_credit == CHUNKS_AHEAD * CHUNK_MIN_AVG  # capped


def test_the_app_gets_bytes_whichever_uvicorn(make_server, monkeypatch):
    """Under uvicorn's `receive` before 0.42 (`self.body` handed out as it is, then b""),
    every cycle is ours and the app still gets bytes: a page in 64 KiB chunks is stored."""

    async def old_receive(self):  # uvicorn 0.41's, less the 100-continue
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        message = {"type": "http.request", "body": self.body, "more_body": self.more_body}
        self.body = b""
        return message

    seen: list[type] = []
    ours = _Cycle.receive

    async def spy(self):
        message = await ours(self)
        seen.append(type(message.get("body", b"")))
        return message

    monkeypatch.setattr(RequestResponseCycle, "receive", old_receive)
    monkeypatch.setattr(_Cycle, "receive", spy)
    srv = make_server()
    c = srv.client()
    c.put_namespace("big", BIG)
    page = os.urandom(BIG)
    s = engine_connection(srv)
    s.sendall(put_head("big", "old") + chunked(page, 64 * 1024))
    assert answer(s) == (201, {"stored": True, "created": True})
    assert c.get_page("big", "old") == page
    assert seen and set(seen) == {bytes}, seen


def test_the_framing_budget_grows_with_the_data(make_server):
    """`max_head` 4 KiB: a 1 MiB page in 1 KiB chunks has 7 KiB of framing, within 4 KiB
    + 1/FRAMING_SHARE of its data (16 KiB); with 32 bytes of extension a chunk, not."""
    srv = make_server(max_head=4096)
    c = srv.client()
    c.put_namespace("big", BIG)
    page = os.urandom(BIG)
    pieces = [page[i : i + 1024] for i in range(0, BIG, 1024)]
    framing = len(framed(*pieces)) - BIG
    assert 4096 < framing < 4096 + BIG // FRAMING_SHARE < framing + 32 * len(pieces)
    s = engine_connection(srv)
    s.sendall(put_head("big", "k") + framed(*pieces))
    assert answer(s) == (201, {"stored": True, "created": True})
    assert c.get_page("big", "k") == page
    s.sendall(put_head("big", "ext") + framed(*pieces, ext=b";e=" + b"x" * 29))
    assert refused(s, 431, "headers_too_large")
    assert c.exists("big", ["ext"]) == 0


# -- the finding: 1-byte chunks on both listeners, /healthz timed from a process of its own ---
PROBE = """
import http.client, socket, sys, time
port, path = int(sys.argv[1]), sys.argv[2]
class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(path)
conns = {"tcp": http.client.HTTPConnection("127.0.0.1", port, timeout=10), "unix": Unix("x")}
print("ready", flush=True)
while True:
    for name, conn in conns.items():
        t0 = time.perf_counter()
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        resp.read()
        print(name, resp.status, time.perf_counter() - t0, flush=True)
    time.sleep(0.005)
"""


def _rounds(path: str, url: str, stop, results) -> None:
    """In a child: rounds of `tiny_chunk_round` until `stop`; every outcome on `results`."""
    out, n = [], 0
    while not stop.is_set() or n == 0:
        out += tiny_chunk_round(path, url, f"r{n}-")
        n += 1
    results.put((n, out))


def test_tiny_chunks_on_both_listeners_leave_healthz_fast(spawn):
    """32 engine-socket and 16 anonymous TCP connections (no token set) each send a page
    PUT in 1-byte chunks (64 KiB of them: 10,922 chunks) at once, round after round, while /healthz is
    timed on both listeners. Each is refused (400 chunks_too_small, maybe after the app's
    own 4xx) and closed by the server, nothing is stored, and /healthz stays fast. Before
    the fix every chunk got a fresh head budget and every one was parsed: /healthz stalled
    for seconds and no connection was closed. Then a page in 64 KiB chunks is stored on both
    listeners and read back byte for byte."""
    proc = spawn("--host-pool", "64MiB", "--no-file-tier").wait_ready()
    engine, anon = SidecarClient(proc.socket_url), SidecarClient(proc.url)
    engine.put_namespace("eng", PAGE)
    anon.put_namespace("anon", PAGE)
    prober = subprocess.Popen(
        [sys.executable, "-c", PROBE, str(proc.port), proc.socket],
        stdout=subprocess.PIPE,
        text=True,
    )
    ctx = mp.get_context("fork")
    stop, results = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_rounds, args=(proc.socket, proc.url, stop, results))
    try:
        assert prober.stdout.readline() == "ready\n"
        child.start()
        latencies = []
        while len(latencies) < 200:  # probes while the rounds run
            name, status, seconds = prober.stdout.readline().split()
            assert status == "200"
            latencies.append(float(seconds))
        stop.set()
        rounds, outcome = results.get(timeout=60)
    finally:
        prober.kill()
        prober.wait(30)
        child.join(30)
        if child.is_alive():
            child.kill()
    lat = sorted(latencies)
    over = [x for x in lat if x > PROBE_LIMIT]
    print(
        f"{rounds} rounds, {len(outcome)} connections; probes {len(lat)} median"
        f" {statistics.median(lat) * 1e3:.1f} ms max {lat[-1] * 1e3:.1f} ms;"
        f" closed after {max(c or 99 for _, c in outcome):.2f} s at most"
    )
    assert rounds >= 1 and len(outcome) == rounds * (FLOODS_ENGINE + FLOODS_TCP)
    for got, closed_at in outcome:
        assert refused_chunks(got, closed_at), (closed_at, got[-300:])
        assert closed_at is not None and closed_at < 5, closed_at
    for r in range(rounds):
        keys = [f"r{r}-{i}" for i in range(FLOODS_ENGINE + FLOODS_TCP)]
        assert engine.exists("eng", keys[:FLOODS_ENGINE]) == 0
        assert anon.exists("anon", keys[FLOODS_ENGINE:]) == 0
    # every probe within 50 ms (33-38 ms at most here), but a loaded 2-core machine
    # deschedules the server or the prober now and then (tests/api/test_bounds.py): 1 probe
    # in 20 may be over, none by 4x (before the fix one round stalled /healthz 430 ms)
    assert statistics.median(lat) < PROBE_LIMIT / 5
    assert len(over) <= max(2, len(lat) // 20), over
    assert lat[-1] < 4 * PROBE_LIMIT, lat[-1]
    for c, ns, conn in (
        (engine, "eng", socket.socket(socket.AF_UNIX)),
        (anon, "anon", socket.socket(socket.AF_INET)),
    ):
        c.put_namespace(f"{ns}-big", BIG)
        page = os.urandom(BIG)
        conn.settimeout(10)
        conn.connect(proc.socket if conn.family == socket.AF_UNIX else ("127.0.0.1", proc.port))
        conn.sendall(put_head(f"{ns}-big", "whole") + chunked(page, 64 * 1024))
        assert answer(conn) == (201, {"stored": True, "created": True})
        assert c.get_page(f"{ns}-big", "whole") == page
        conn.close()
