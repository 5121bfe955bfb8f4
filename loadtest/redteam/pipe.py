"""Red-team attacks on HTTP/1.1 pipelining (issue 43, item 1), for `python -m loadtest.redteam.runner`.

A client may send its next requests before it reads an answer; the sidecar parses the next
one only once the answer before it is out (sidecar/server.py), so one read of back-to-back
requests is not a queue of thousands. Here, as uid nobody and without the token: 40
connections on each listener write 256 KB of `GET /healthz` each and never read; and a
head past --max-head pipelined behind a tiny request. The runner times /healthz on both
listeners meanwhile and bounds the sidecar's RSS growth (`rss_per_conn_kib` is printed).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Callable

from loadtest.kit.as_uid import as_user
from loadtest.redteam.attack import Attack, Target, rss_mib
from loadtest.redteam.conn import _shared_stop, _tcp, _unix

CONNECTIONS = 40
FLOOD_BYTES = 256 << 10
GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
BIG_HEAD_KIB = 117  # behind a tiny request, against --max-head 64KiB


def _send_what_fits(s: socket.socket, data: bytes) -> int:
    """Write as much of `data` as the kernel takes now (the server may stop reading)."""
    view, sent = memoryview(data), 0
    s.setblocking(False)
    try:
        while sent < len(data):
            sent += s.send(view[sent:])
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:
        pass
    return sent


def _flood(connect: Callable[[], socket.socket], stop) -> dict:
    """CONNECTIONS connections each write FLOOD_BYTES of pipelined requests, read nothing
    until `stop`; then a client that pipelines and reads gets every answer."""
    data = GET * (FLOOD_BYTES // len(GET))
    socks = [connect() for _ in range(CONNECTIONS)]
    sent = sum(_send_what_fits(s, data) for s in socks)
    stop.wait()
    for s in socks:
        s.close()
    n = 200
    s = connect()
    s.settimeout(10)
    s.sendall(GET * n)  # a client that reads: all answered, in order
    got = b""
    try:
        while got.count(b"HTTP/1.1 200 ") < n:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            got += chunk
    except OSError:
        pass
    s.close()
    return {
        "connections": CONNECTIONS,
        "sent_kib": sent >> 10,
        "requests_sent": sent // len(GET),
        "reader_answered": got.count(b"HTTP/1.1 200 "),
        "reader_of": n,
    }


def _watched(t: Target, stop: threading.Event, connect: Callable[[], socket.socket]) -> dict:
    """Run the flood as uid nobody while sampling the sidecar's RSS: its growth a connection."""
    start, peak, done = rss_mib(t.pid) or 0.0, [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], rss_mib(t.pid) or 0.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = as_user(_flood, connect, _shared_stop(stop))
    finally:
        done.set()
        sampler.join()
    per_conn = max(peak[0] - start, 0.0) * 1024 / CONNECTIONS
    return {
        "held": out["reader_answered"] == out["reader_of"],
        **out,
        "rss_per_conn_kib": round(per_conn),
    }


def flood_tcp(t: Target, stop: threading.Event) -> dict:
    return _watched(t, stop, lambda: _tcp(t.url))


def flood_engine(t: Target, stop: threading.Event) -> dict:
    return _watched(t, stop, lambda: _unix(t.socket))


def _head_behind(connect: Callable[[], socket.socket]) -> list[str]:
    """A tiny request and, in the same write, one with a BIG_HEAD_KIB header: the answers."""
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (BIG_HEAD_KIB << 10) + b"\r\n\r\n"
    s = connect()
    s.settimeout(10)
    with contextlib.suppress(OSError):  # refused and closed before it is all sent
        s.sendall(GET + big)
    got = b""
    try:
        while chunk := s.recv(1 << 16):
            got += chunk
    except OSError:
        pass
    s.close()
    return [m.decode() for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", got)]


def _heads(url: str, path: str) -> dict:
    return {"tcp": _head_behind(lambda: _tcp(url)), "engine": _head_behind(lambda: _unix(path))}


def head_behind_tiny(t: Target, stop: threading.Event) -> dict:
    out = as_user(_heads, t.url, t.socket)
    held = all(a[:1] == ["200"] and a[1:] in (["431"], ["414"]) for a in out.values())
    return {"held": held, "answers": out}


ATTACKS = [
    Attack(43, "pipelined_healthz_40_tcp", flood_tcp, seconds=6.0, rss_limit_mib=64.0),
    Attack(
        43, "pipelined_healthz_40_engine", flood_engine, seconds=6.0, token=None, rss_limit_mib=64.0
    ),
    Attack(
        43,
        "pipelined_head_past_max_head",
        head_behind_tiny,
        seconds=2.0,
        sidecar_args=("--max-head", "64KiB"),
    ),
]
