"""Connections (issue 26, items 2, 3, 6 and 10): fds refused on the engine socket, request
heads capped before they are joined, caps per listener and per uid, TCP closed to callers
without the token, a deadline for a whole body and a timeout for answers nobody reads.
Every case runs on real sockets against a live server; waits are on the server's own
counts (`Registry.tally`) or on the socket being closed, never on a sleep (the one paced
sender is the trickle attack itself)."""

from __future__ import annotations

import array
import errno
import http.client
import logging
import os
import socket
import struct
import threading

import orjson
import pytest

from api.engine.client import SidecarClient
from loadtest.redteam.hostile import lingering_tcp
from sidecar import connections
from sidecar.connections import SO_PASSRIGHTS, refuse_fd_passing
from sidecar.server import PeerHttpProtocol
from tests.conftest import engine_connection, wait_for

NOBODY = 65534
PAGE = 4096
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another uid needs root")


def registry(srv) -> connections.Registry:
    return srv.server.config.http.registry


def tcp(srv, timeout: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.config.port), timeout=timeout)


def closed_by_server(s: socket.socket) -> bool:
    """Read until the server closes (True) or the socket's timeout passes (False)."""
    try:
        while True:
            if not s.recv(1 << 16):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def answer(s: socket.socket) -> tuple[int, dict]:
    resp = http.client.HTTPResponse(s)
    resp.begin()
    return resp.status, orjson.loads(resp.read())


def healthz(s: socket.socket) -> int:
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    resp = http.client.HTTPResponse(s)
    resp.begin()
    resp.read()
    return resp.status


def kernel_refuses_fds() -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
            return True
        except OSError:
            return False


# -- item 2: SCM_RIGHTS on the HTTP engine socket ----------------------------------------
@pytest.mark.skipif(not kernel_refuses_fds(), reason="the kernel lacks SO_PASSRIGHTS")
def test_the_engine_socket_refuses_an_fd_sent_with_a_byte(server, client):
    listener, linger = lingering_tcp(30)
    peer = engine_connection(server)
    with pytest.raises(PermissionError) as e:  # the kernel refuses: nothing reaches the loop
        peer.sendmsg(
            [b"G"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [linger.fileno()]))]
        )
    assert e.value.errno == errno.EPERM
    assert healthz(peer) == 200  # the connection itself is unharmed
    assert client.health()["status"] == "ok"
    for s in (peer, listener):
        s.close()
    linger.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    linger.close()


def test_a_kernel_without_so_passrights_logs_one_warning(caplog):
    class OldKernelSocket:
        def setsockopt(self, *args):
            raise OSError(errno.ENOPROTOOPT, os.strerror(errno.ENOPROTOOPT))

    with caplog.at_level(logging.WARNING, logger="kv_sidecar"):
        assert refuse_fd_passing(OldKernelSocket()) is False
    assert [r.message for r in caplog.records if "SO_PASSRIGHTS" in r.message] != []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        assert refuse_fd_passing(s) is kernel_refuses_fds()


# -- item 3: request heads ------------------------------------------------------------------
@pytest.fixture
def fed(monkeypatch):
    """Bytes each connection's parser was fed, by connection (a spy on `_feed`)."""
    seen: dict[int, int] = {}
    real = PeerHttpProtocol._feed

    def spy(self, data):
        seen[id(self)] = seen.get(id(self), 0) + len(data)
        return real(self, data)

    monkeypatch.setattr(PeerHttpProtocol, "_feed", spy)
    return seen


@pytest.mark.parametrize(
    "head,status,code",
    [
        (b"GET /" + b"a" * (1 << 20), 414, "url_too_long"),  # request line
        (
            b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * (1 << 20),
            431,
            "headers_too_large",
        ),  # one header
    ],
)
def test_a_huge_head_is_refused_before_it_is_buffered(make_server, fed, head, status, code):
    srv = make_server(token="s3cret")
    s = tcp(srv)  # a caller without the token
    s.sendall(head)  # 1 MiB, never finished
    assert answer(s) == (status, {"error": {"code": code, "message": answer_message(status)}})
    assert closed_by_server(s)
    assert max(fed.values()) <= 64 * 1024  # the parser saw the cap, not the megabyte
    assert registry(srv).tally.counts[code] == 1
    assert SidecarClient(srv.url, token="s3cret").health()["status"] == "ok"


def answer_message(status: int) -> str:
    return (
        "the request line is over 65536 bytes"
        if status == 414
        else "the request head is over 65536 bytes"
    )


def test_header_fields_are_counted(server):
    s = engine_connection(server)
    fields = b"".join(b"X-F%d: v\r\n" % i for i in range(99))  # + Host: 100 fields
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
    assert answer(s)[0] == 200
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + fields + b"X-Last: v\r\n\r\n")
    status, body = answer(s)
    assert (status, body["error"]["code"]) == (431, "headers_too_large")
    assert closed_by_server(s)


def test_a_body_in_the_same_read_as_its_head_is_not_a_head(server, client):
    """Head and a 1 MiB body in one write: the bytes past the head budget are body."""
    client.put_namespace("big", 1 << 20)
    s = engine_connection(server)
    s.sendall(
        b"PUT /v1/namespaces/big/pages/k HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        % (1 << 20)
        + b"p" * (1 << 20)
    )
    assert answer(s) == (201, {"stored": True, "created": True})
    assert client.get_page("big", "k") == b"p" * (1 << 20)


def chunked(body: bytes, size: int, trailer: bytes = b"") -> bytes:
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    )
    return chunks + b"0\r\n" + trailer + b"\r\n"


def test_chunk_framing_is_not_a_head_but_a_trailer_is(server, client):
    client.put_namespace("kv", PAGE)
    head = (
        b"POST /v1/namespaces/kv/exists HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    body = b'{"keys": []}' + b" " * 200_000  # 196 chunks of 1 KiB: 3 head budgets of data
    s = engine_connection(server)
    s.sendall(head + chunked(body, 1024))
    assert answer(s) == (200, {"prefix": 0})
    s.sendall(head + chunked(body, 4096, b"X-Trailer: " + b"t" * (128 << 10) + b"\r\n"))
    status, reply = answer(s)
    assert (status, reply["error"]["code"]) == (431, "headers_too_large")


# -- item 6: caps per listener, per uid, and TCP without the token --------------------------
def test_idle_tcp_connections_leave_the_engine_socket_serving(make_server):
    srv = make_server(token="s3cret", max_connections=8)
    idle = [tcp(srv) for _ in range(8)]  # TCP full of callers without the token
    wait_for(lambda: registry(srv).open["tcp"] == 8)
    engine = srv.client()
    engine.put_namespace("kv", PAGE)
    assert [engine.exists("kv", [f"k{i}"]) for i in range(40)] == [0] * 40
    operator = SidecarClient(srv.url, token="s3cret")
    assert operator.stats()["uptime_s"] >= 0  # a new TCP connection closes the oldest idle one
    assert closed_by_server(idle[0])
    assert registry(srv).open["tcp"] == 8 and registry(srv).tally.counts["tcp_evicted"] >= 1
    for s in idle:
        s.close()


def test_a_full_tcp_listener_closes_the_least_recently_active_caller(make_server):
    srv = make_server(token="s3cret", max_connections=3)
    first, second, third = tcp(srv), tcp(srv), tcp(srv)
    wait_for(lambda: registry(srv).open["tcp"] == 3)  # all three accepted, in this order
    assert healthz(first) == 200  # the oldest, but active just now
    fourth = tcp(srv)
    assert healthz(fourth) == 200
    assert closed_by_server(second)  # the least recently active without the token
    assert healthz(first) == 200 and healthz(third) == 200
    for s in (first, third, fourth):
        s.close()


def connect_as(uid: int, path: str, n: int) -> list[socket.socket]:
    """`n` connections to the Unix socket `path` made by a child running as `uid` (their
    SO_PEERCRED is the child's), handed back to this process with SCM_RIGHTS."""
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
            for s in socks:
                s.connect(path)
            socket.send_fds(there, [b"x"], [s.fileno() for s in socks])
            code = 0
        finally:
            os._exit(code)
    there.close()
    _, fds, _, _ = socket.recv_fds(here, 1, n)
    os.waitpid(pid, 0)
    here.close()
    assert len(fds) == n
    return [socket.socket(fileno=fd) for fd in fds]


@root_only
def test_one_uid_cannot_take_the_engine_socket(make_server):
    srv = make_server(socket_mode=0o666, max_connections=8, max_connections_per_uid=3)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    theirs = connect_as(NOBODY, srv.config.socket, 4)
    for s in theirs:
        s.settimeout(10)
    assert closed_by_server(theirs[3])  # the uid's 4th: closed at once
    assert [healthz(s) for s in theirs[:3]] == [200] * 3
    assert registry(srv).by_uid[NOBODY] == 3 and registry(srv).tally.counts["uid_full"] == 1
    mine = [engine_connection(srv) for _ in range(3)]  # another uid still gets in
    assert [healthz(s) for s in mine] == [200] * 3
    for s in theirs + mine:
        s.close()


def test_tcp_without_the_token_is_closed_quickly(make_server):
    srv = make_server(token="s3cret", auth_timeout=0.3)
    shown = tcp(srv)
    shown.sendall(b"GET /v1/stats HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n\r\n")
    assert answer(shown)[0] == 200
    idle = tcp(srv)
    assert closed_by_server(idle)  # 0.3 s, not the 30 s read timeout
    assert registry(srv).tally.counts["auth_timeout"] == 1
    shown.sendall(b"GET /v1/stats HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n\r\n")
    assert answer(shown)[0] == 200  # idle as long, but it showed the token
    wrong = http.client.HTTPConnection("127.0.0.1", srv.config.port, timeout=10)
    wrong.request("POST", "/v1/stats", body=b"{}", headers={"Authorization": "Bearer nope"})
    assert wrong.getresponse().status == 401  # head and body written apart: still read
    assert closed_by_server(wrong.sock)  # and then closed
    wait_for(lambda: registry(srv).open["tcp"] == 1)
    shown.close()


# -- item 10: a deadline for the body, a timeout for answers nobody reads -------------------
def put_head(name: str, key: str, size: int) -> bytes:
    return b"PUT /v1/namespaces/%s/pages/%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (
        name.encode(),
        key.encode(),
        size,
    )


def test_a_body_that_never_completes_is_cut_at_its_deadline(make_server):
    srv = make_server(body_timeout=0.3)  # the read timeout stays 30 s
    c = srv.client()
    c.put_namespace("kv", PAGE)
    s = engine_connection(srv)
    s.sendall(put_head("kv", "u", PAGE) + b"u" * 100)
    wait_for(lambda: "u" in srv.on_loop(lambda: srv.ns("kv").pool.entries))  # its slot is held
    assert closed_by_server(s)
    assert registry(srv).tally.counts["body_deadline"] == 1
    wait_for(lambda: "u" not in srv.on_loop(lambda: srv.ns("kv").pool.entries), 10)
    assert c.exists("kv", ["u"]) == 0
    srv.invariants()


def test_a_trickling_body_is_cut_although_every_byte_is_in_time(make_server):
    """One byte every 50 ms under a 1 s read timeout: only the 1.5 s deadline ends it."""
    srv = make_server(read_timeout=1.0, body_timeout=1.5)
    srv.client().put_namespace("kv", PAGE)
    s = engine_connection(srv)
    s.sendall(put_head("kv", "t", PAGE))
    done, sent = threading.Event(), [0]

    def trickle():
        try:
            while not done.wait(0.05):  # the attack's pace, not a wait for the server
                s.send(b"t")
                sent[0] += 1
        except OSError:
            pass

    t = threading.Thread(target=trickle)
    t.start()
    assert closed_by_server(s)
    done.set()
    t.join()
    counts = registry(srv).tally.counts
    assert counts["body_deadline"] == 1 and counts["read_stalled"] == 0
    assert 0 < sent[0] < PAGE


def test_answers_nobody_reads_are_dropped_after_the_write_timeout(make_server, monkeypatch):
    srv = make_server(write_timeout=0.3, segment_size=4 << 20)
    c = srv.client()
    c.put_namespace("big", 4 << 20)
    c.put_page("big", "k", b"b" * (4 << 20))
    stalled = threading.Event()
    real = PeerHttpProtocol._write_stalled

    def spy(self):
        real(self)
        stalled.set()

    monkeypatch.setattr(PeerHttpProtocol, "_write_stalled", spy)
    s = engine_connection(srv)
    s.sendall(b"GET /v1/namespaces/big/pages/k HTTP/1.1\r\nHost: x\r\n\r\n")  # never read
    assert stalled.wait(10)
    got = 0
    try:
        while chunk := s.recv(1 << 20):
            got += len(chunk)
    except ConnectionResetError:
        pass
    assert got < 4 << 20  # the rest of the answer was dropped
    wait_for(lambda: registry(srv).open["engine"] == 1)  # the client's own connection
    assert c.get_page("big", "k") == b"b" * (4 << 20)


# -- configuration ---------------------------------------------------------------------------
def test_connection_settings_from_flags_environment_and_file(tmp_path):
    from sidecar.cli import parser
    from sidecar.config import load

    f = tmp_path / "c.toml"
    f.write_text('max_head = "32KiB"\nmax_header_fields = 50\nwrite_timeout = 7\n')
    env = {"SIDECAR_AUTH_TIMEOUT": "2.5", "SIDECAR_MAX_CONNECTIONS_PER_UID": "16"}
    args = vars(parser().parse_args(["serve", "--body-timeout", "9", "--max-connections", "64"]))
    cfg = load(
        str(f), env=env, overrides={k: v for k, v in args.items() if k not in ("command", "config")}
    )
    assert (
        cfg.max_head,
        cfg.max_header_fields,
        cfg.write_timeout,
        cfg.auth_timeout,
        cfg.max_connections_per_uid,
        cfg.body_timeout,
        cfg.max_connections,
    ) == (32 << 10, 50, 7.0, 2.5, 16, 9.0, 64)
    for bad in (
        {"SIDECAR_MAX_HEAD": "0"},
        {"SIDECAR_BODY_TIMEOUT": "0"},
        {"SIDECAR_MAX_CONNECTIONS_PER_UID": "0"},
    ):
        with pytest.raises(ValueError):
            load(None, env=bad)
