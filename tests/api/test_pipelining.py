"""HTTP/1.1 pipelining (issue 43, item 1): a request is parsed only once the answer before it
is out, so a client that writes thousands of requests and never reads holds one here, not
thousands; the bytes of a pipelined request count against its head from its first byte; and
a pipelining client that reads gets every answer, in order. Real sockets against a live
server, on both listeners; waits are on the server's own events (a spy on `pause_writing`)
or on the socket being closed, never on a sleep."""

from __future__ import annotations

import socket
import threading
from typing import BinaryIO

import pytest

from sidecar import server as server_module
from sidecar.server import PeerHttpProtocol
from tests.api.test_connections import chunked, closed_by_server, registry, tcp
from tests.conftest import engine_connection

PAGE = 4096
BIG = 1 << 20
GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def connect(srv, listener: str, rcvbuf: int = 0) -> socket.socket:
    """A raw connection to `listener`; `rcvbuf`: a small receive buffer (answers back up soon)."""
    if listener == "engine":
        return engine_connection(srv)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", srv.config.port))
    return s


def read_answers(f: BinaryIO, n: int) -> list[tuple[int, bytes]]:
    """`n` answers (status, body) read in turn from one buffered reader of the connection."""
    out = []
    for _ in range(n):
        status = int(f.readline().split()[1])
        length = 0
        while (line := f.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        out.append((status, f.read(length)))
    return out


def put(ns: str, key: str, body: bytes) -> bytes:
    return b"PUT /v1/namespaces/%s/pages/%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
        ns.encode(),
        key.encode(),
        len(body),
        body,
    )


def get(ns: str, key: str) -> bytes:
    return b"GET /v1/namespaces/%s/pages/%s HTTP/1.1\r\nHost: x\r\n\r\n" % (
        ns.encode(),
        key.encode(),
    )


EXISTS_CHUNKED = (
    b"POST /v1/namespaces/kv/exists HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    + chunked(b'{"keys": ["k0"]}', 5)
)


@pytest.fixture
def depth(monkeypatch):
    """Requests parsed but not yet answered, by connection, each time one is parsed; and the
    protocol objects seen (a spy on the parser's and the answers' callbacks)."""
    seen: dict[int, list[int]] = {}
    count: dict[int, int] = {}
    protos: dict[int, PeerHttpProtocol] = {}
    parsed, answered = PeerHttpProtocol.on_headers_complete, PeerHttpProtocol.on_response_complete

    def on_headers_complete(self):
        parsed(self)
        count[id(self)] = count.get(id(self), 0) + 1
        protos[id(self)] = self
        seen.setdefault(id(self), []).append(count[id(self)])

    def on_response_complete(self):
        count[id(self)] -= 1
        answered(self)

    monkeypatch.setattr(PeerHttpProtocol, "on_headers_complete", on_headers_complete)
    monkeypatch.setattr(PeerHttpProtocol, "on_response_complete", on_response_complete)
    return seen, protos


@pytest.fixture
def paused(monkeypatch) -> threading.Event:
    """Set once the server stops writing to a connection (its client reads nothing), or
    refuses one (so that a broken rule fails at once, not at a timeout)."""
    event = threading.Event()
    for name in ("pause_writing", "_refuse"):
        real = getattr(PeerHttpProtocol, name)

        def spy(self, *args, real=real):
            real(self, *args)
            event.set()

        monkeypatch.setattr(PeerHttpProtocol, name, spy)
    return event


def send_what_fits(s: socket.socket, data: bytes) -> int:
    s.setblocking(False)
    sent = 0
    try:
        while sent < len(data):
            sent += s.send(data[sent:])
    except BlockingIOError:
        pass
    s.settimeout(10)
    return sent


@pytest.mark.parametrize("listener", ["engine", "tcp"])
def test_pipelined_requests_are_answered_in_order(server, listener):
    c = server.client() if listener == "engine" else server.tcp_client()
    c.put_namespace("kv", PAGE)
    pages = [bytes([i]) * PAGE for i in range(8)]
    burst = b"".join(
        put("kv", f"k{i}", p) + GET + get("kv", f"k{i}") + get("kv", "none")
        for i, p in enumerate(pages)
    )
    burst += EXISTS_CHUNKED + GET * 5 + b"\r\n" + GET  # a chunked body, then requests in its piece
    s = connect(server, listener)
    s.sendall(burst)
    got = read_answers(s.makefile("rb"), 4 * len(pages) + 7)
    for i, p in enumerate(pages):
        assert [status for status, _ in got[4 * i : 4 * i + 4]] == [201, 200, 200, 404]
        assert got[4 * i + 2][1] == p
    assert got[-7] == (200, b'{"prefix":1}')
    assert got[-6:] == [(200, b'{"status":"ok"}')] * 6
    s.close()


@pytest.mark.parametrize("listener", ["engine", "tcp"])
def test_a_client_that_never_reads_has_one_request_parsed_ahead(
    make_server, depth, paused, listener
):
    srv = make_server(segment_size=BIG)
    c = srv.client() if listener == "engine" else srv.tcp_client()
    c.put_namespace("big", BIG)
    c.put_page("big", "k", b"b" * BIG)
    seen, protos = depth
    flood = get("big", "k") * 6000  # one write of 6,000 requests for 1 MiB each
    with connect(srv, listener, rcvbuf=4096) as s:
        assert send_what_fits(s, flood) > 64 * 1024
        assert paused.wait(30)  # its answers back up: the server waits
        (mine,) = [k for k, p in protos.items() if p.flow.write_paused]
        assert max(seen[mine]) <= 2  # parsed ahead of their answers
        assert len(seen[mine]) < 100
        for other in ("engine", "tcp"):  # meanwhile, other connections are served
            with connect(srv, other) as o:
                o.sendall(GET)
                assert read_answers(o.makefile("rb"), 1) == [(200, b'{"status":"ok"}')]
        assert max(seen[mine]) <= 2 and len(seen[mine]) < 100


def test_small_answers_nobody_reads_wait_here_one_at_a_time(server, depth, paused):
    """Answers go out one at a time: a client that never reads leaves one here, not the
    write buffer's 64 KiB of them (hundreds of small writes cost memory each)."""
    seen, protos = depth
    with engine_connection(server) as s:
        assert send_what_fits(s, GET * (256 * 1024 // len(GET))) > 64 * 1024
        assert paused.wait(30)
        (mine,) = [k for k, p in protos.items() if p.flow.write_paused]
        waiting = server.on_loop(lambda: protos[mine].transport.get_write_buffer_size())
        assert 0 < waiting <= 256  # part of the one answer it did not read
        assert max(seen[mine]) <= 2


@pytest.mark.parametrize("listener", ["engine", "tcp"])
def test_a_head_pipelined_behind_a_tiny_request_counts_from_its_first_byte(make_server, listener):
    srv = make_server(max_head=64 * 1024)
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (117 << 10) + b"\r\n\r\n"
    s = connect(srv, listener)
    s.sendall(GET + big)
    got = read_answers(s.makefile("rb"), 2)
    assert [status for status, _ in got] == [200, 431]
    assert closed_by_server(s)
    assert registry(srv).tally.counts["headers_too_large"] == 1


def test_a_head_in_the_piece_that_ended_a_chunked_body_counts_from_its_first_byte(make_server):
    """The piece that ends a chunked body runs on into the next request: all of it counts."""
    srv = make_server(max_head=64 * 1024)
    srv.client().put_namespace("kv", PAGE)
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (100 << 10) + b"\r\n\r\n"
    s = engine_connection(srv)
    s.sendall(EXISTS_CHUNKED + big)
    got = read_answers(s.makefile("rb"), 2)
    assert [status for status, _ in got] == [200, 431]
    assert closed_by_server(s)


def test_requests_parsed_ahead_past_the_bound_cut_the_connection(server, client, monkeypatch):
    """No client gets there (a chunked body's piece holds 8 requests at most): the bound
    itself, lowered to 2 here."""
    monkeypatch.setattr(server_module, "PIPELINE_MAX", 2)
    client.put_namespace("kv", PAGE)
    s = engine_connection(server)
    s.sendall(EXISTS_CHUNKED + GET * 5)
    assert closed_by_server(s)
    assert registry(server).tally.counts["pipeline_full"] == 1
    assert client.health()["status"] == "ok"


def test_blank_lines_after_an_answer_do_not_keep_a_connection(make_server):
    srv = make_server(read_timeout=0.3)
    s = tcp(srv)
    s.sendall(GET)
    assert read_answers(s.makefile("rb"), 1)[0][0] == 200
    s.sendall(b"\r\n" * 8)  # cancels keep-alive's timer, begins nothing
    assert closed_by_server(s)
    assert registry(srv).tally.counts["read_stalled"] == 1


def test_requests_behind_a_401_are_not_served(make_server):
    srv = make_server(token="s3cret")
    s = tcp(srv)
    s.sendall(GET + b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n\r\n" + GET * 50)
    f = s.makefile("rb")
    assert [status for status, _ in read_answers(f, 2)] == [200, 401]
    assert f.read() == b""  # then closed: nothing else answered
