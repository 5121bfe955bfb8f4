"""Red-team attacks on connections (issue 26, items 2, 3, 6 and 10; issue 52, item 3), for
`python -m loadtest.redteam.runner`. Each runs against a fresh root sidecar (loadtest/redteam/runner.py);
the attacker is a child process of uid nobody, the victim engine one of another uid.
A child cannot see the runner's `stop` event: `_shared_stop` mirrors it into one a forked
child can."""

from __future__ import annotations

import array
import contextlib
import multiprocessing as mp
import re
import selectors
import socket
import struct
import threading
import time

from api.engine.client import SidecarClient, SidecarError
from loadtest.kit.as_uid import as_user
from loadtest.redteam.attack import Attack, Target
from loadtest.redteam.hostile import lingering_tcp

OTHER = 65532  # the victim tenant's uid
BIG_HEAD = 48 << 20  # item 3: a 48 MiB request line or header
IDLE_CONNECTIONS = 1030  # item 6


def _shared_stop(stop: threading.Event):
    """An Event a forked child sees, set when `stop` is."""
    shared = mp.get_context("fork").Event()
    threading.Thread(target=lambda: (stop.wait(), shared.set()), daemon=True).start()
    return shared


def _unix(path: str, timeout: float | None = 10) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def _tcp(url: str, timeout: float = 10) -> socket.socket:
    host, port = url.rsplit("/", 1)[1].split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def _closed(s: socket.socket) -> bool:
    """Read what is left; True when the server closed (EOF or reset), False on a timeout."""
    try:
        while s.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _engine_requests(url: str, token, n: int) -> int:
    """How many of `n` exists calls an engine (own namespace, own uid) gets answered."""
    c = SidecarClient(url, token=token, timeout=10)
    c.put_namespace("victim", 4096)
    served = 0
    for i in range(n):
        with contextlib.suppress(SidecarError):
            served += c.exists("victim", [f"k{i}"]) == 0
    return served


# -- 2: an fd with SCM_RIGHTS on the HTTP engine socket ------------------------------------
def _send_fds(path: str, stop) -> dict:
    """Each round: a fresh lingering socket, sent with a byte, this process's copy closed,
    so that the sidecar's copy is the last one (its close would block for the linger). The
    listeners stay open until the end: closing one would reset its connection first."""
    out, listeners = {"eperm": 0, "sent": 0}, []
    while not stop.is_set():
        listener, linger = lingering_tcp(10)  # its last close blocks up to 10 s
        listeners.append(listener)
        s = _unix(path)
        try:
            s.sendmsg(
                [b"G"],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [linger.fileno()]))],
            )
            out["sent"] += 1
        except PermissionError:
            out["eperm"] += 1
            linger.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        linger.close()
        s.close()
        stop.wait(0.2)
    for listener in listeners:
        listener.close()
    return out


def fd_on_http_socket(t: Target, stop: threading.Event) -> dict:
    out = as_user(_send_fds, t.socket, _shared_stop(stop))
    return {"held": out["sent"] == 0 and out["eperm"] > 0, **out}


# -- 3: a 48 MiB request line or header, without the token ---------------------------------
def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _big_head(url: str, path: str, stop) -> dict:
    heads = (b"GET /" + b"a" * BIG_HEAD, b"GET / HTTP/1.1\r\nX-Big: " + b"a" * BIG_HEAD)
    out = {"tries": 0, "fully_sent": 0, "answers": {}}
    while not stop.is_set():
        i = out["tries"]
        s = _tcp(url) if i % 2 == 0 else _unix(path)  # TCP without the token, and the engine socket
        try:
            s.sendall(heads[(i // 2) % 2])
            out["fully_sent"] += 1
        except OSError:
            pass
        try:
            status = s.recv(64).split(b" ")[1].decode()
        except (OSError, IndexError):
            status = "reset"
        out["answers"][status] = out["answers"].get(status, 0) + 1
        s.close()
        out["tries"] += 1
    return out


def huge_head(t: Target, stop: threading.Event) -> dict:
    before = _rss_anon(t.pid)
    out = as_user(_big_head, t.url, t.socket, _shared_stop(stop))
    grew = (_rss_anon(t.pid) - before) >> 20
    held = (
        out["tries"] > 0
        and out["fully_sent"] == 0
        and grew < 16
        and set(out["answers"]) <= {"414", "431", "reset"}
    )
    return {"held": held, **out, "rss_grew_mib": grew}


# -- 6: idle connections, on TCP without the token and on the engine socket by one uid -----
def _hold_idle(connect, stop) -> dict:
    """Keep IDLE_CONNECTIONS open (reopening what the server closes) until `stop`."""
    socks, opened, closed = [], 0, 0
    while not stop.is_set():
        while len(socks) < IDLE_CONNECTIONS:
            try:
                socks.append(connect())
                opened += 1
            except OSError:
                break
        for s in socks:
            s.setblocking(False)
        alive = []
        for s in socks:
            try:
                gone = s.recv(1) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            closed += gone
            (s.close() if gone else alive.append(s))
        socks = alive
        stop.wait(1.0)  # then reopen what the server closed
    for s in socks:
        s.close()
    return {"opened": opened, "closed_by_server": closed}


def _victims(t: Target) -> dict:
    engine = as_user(_engine_requests, t.socket_url, t.token, 40, uid=OTHER)
    operator = SidecarClient(t.url, token=t.token, timeout=10)
    try:
        operator_ok = operator.stats()["uptime_s"] >= 0
    except SidecarError:
        operator_ok = False
    return {"engine_served": engine, "operator_served": operator_ok}


def _attack_then_victims(t: Target, stop: threading.Event, connect, seconds: float) -> dict:
    shared = _shared_stop(stop)
    result = {}
    attacker = threading.Thread(target=lambda: result.update(as_user(_hold_idle, connect, shared)))
    attacker.start()
    time.sleep(seconds)  # the attacker's connections are all open by now
    victims = _victims(t)
    stop.wait()
    attacker.join(120)
    return {**victims, **result}


def idle_tcp(t: Target, stop: threading.Event) -> dict:
    out = _attack_then_victims(t, stop, lambda: _tcp(t.url), 2.0)
    held = out["engine_served"] == 40 and out["operator_served"] and out["closed_by_server"] > 0
    return {"held": held, **out}


def one_uid_engine_socket(t: Target, stop: threading.Event) -> dict:
    out = _attack_then_victims(t, stop, lambda: _unix(t.socket), 2.0)
    return {"held": out["engine_served"] == 40, **out}


# -- 10: 64 trickling inline PUTs; answers nobody reads ------------------------------------
PUT_PAGE = 1 << 20


def _trickle(url: str, path: str, stop) -> dict:
    SidecarClient(url).put_namespace("trickle", PUT_PAGE)
    head = b"PUT /v1/namespaces/trickle/pages/k%d HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    socks, lives, start = [], [], time.monotonic()
    for i in range(64):
        s = _unix(path, timeout=None)  # blocking: MSG_DONTWAIT below then never waits
        s.sendall(head % (i, PUT_PAGE))
        socks.append(s)
    answered = 0
    while socks and not stop.is_set():
        for s in list(socks):
            try:
                got = s.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                got = None
            except OSError:
                got = b""
            if got:  # answered before its body was whole (a refusal)
                answered += 1
            if got is not None:  # closed by the server: the body deadline
                lives.append(time.monotonic() - start)
                socks.remove(s)
                s.close()
            else:
                s.send(b"t")  # one byte every 1.5 s: within the 2 s read timeout
        stop.wait(1.5)
    for s in socks:
        s.close()
    return {
        "cut": len(lives),
        "answered": answered,
        "still_open": len(socks),
        "longest_s": round(max(lives, default=0), 1),
    }


def _victim_puts(url: str, tag: str, n: int) -> int:
    c = SidecarClient(url, timeout=30)
    c.put_namespace("mine", PUT_PAGE)
    stored = 0
    for i in range(n):
        try:
            c.put_page("mine", f"{tag}{i}", b"v" * PUT_PAGE)
            stored += 1
        except SidecarError:
            pass
    return stored


def trickling_puts(t: Target, stop: threading.Event) -> dict:
    out = {}
    attacker = threading.Thread(
        target=lambda: out.update(as_user(_trickle, t.socket_url, t.socket, _shared_stop(stop)))
    )
    attacker.start()
    time.sleep(2.0)  # the 64 PUTs hold their slots now
    during = as_user(_victim_puts, t.socket_url, "during", 16, uid=OTHER)
    attacker.join(120)
    after = as_user(_victim_puts, t.socket_url, "after", 16, uid=OTHER)
    held = (
        out["still_open"] == 0
        and out["cut"] == 64
        and out["longest_s"] < 5 + 3
        and during == 16  # another owner stores while they trickle (issue 43, item 6)
        and after == 16
    )  # past the per-owner cap of uploads in flight the rest are answered 429 at once
    return {"held": held, **out, "victim_stored_during": during, "victim_stored_after": after}


def _unread(url: str, path: str, stop) -> dict:
    c = SidecarClient(url)
    c.put_namespace("big", PUT_PAGE)
    c.put_page("big", "k", b"b" * PUT_PAGE)
    socks = []
    for _ in range(64):
        s = _unix(path, timeout=15)
        s.sendall(b"GET /v1/namespaces/big/pages/k HTTP/1.1\r\nHost: x\r\n\r\n")
        socks.append(s)
    stop.wait()  # never read while the attack lasts
    cut = 0
    for s in socks:
        got = 0
        try:
            while chunk := s.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        except TimeoutError:
            got = PUT_PAGE  # still open: the server kept the answer
        cut += got < PUT_PAGE
        s.close()
    return {"connections": len(socks), "cut": cut}


def unread_answers(t: Target, stop: threading.Event) -> dict:
    out = as_user(_unread, t.socket_url, t.socket, _shared_stop(stop))
    return {"held": out["cut"] == out["connections"] == 64, **out}


# -- 52: page PUTs in 1-byte chunks on both listeners -------------------------------------
TINY_CHUNKS = b"1\r\nx\r\n" * (64 * 1024 // 6)  # 64 KiB a connection: 10,922 chunks
CHUNKED_PUT = (
    b"PUT /v1/namespaces/%s/pages/%s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
)
FLOODS_ENGINE, FLOODS_TCP = 32, 16


def tiny_chunk_round(
    path: str, url: str, tag: str, n_engine: int = FLOODS_ENGINE, n_tcp: int = FLOODS_TCP
) -> list[tuple[bytes, float | None]]:
    """One round: `n_engine` connections on the engine socket (page PUTs to namespace `eng`,
    keys `<tag><i>`) and `n_tcp` on TCP (namespace `anon`), all opened first, then each
    sends its PUT in 1-byte chunks as fast as the server takes them, reading what comes
    back until the server closes (30 s at most): [(what came back, seconds to the close, or
    None when it stayed open)]."""
    conns = []
    for i in range(n_engine + n_tcp):
        s = _unix(path) if i < n_engine else _tcp(url)
        s.setblocking(False)
        ns = b"eng" if i < n_engine else b"anon"
        conns.append((s, CHUNKED_PUT % (ns, b"%s%d" % (tag.encode(), i)) + TINY_CHUNKS))
    got = [bytearray() for _ in conns]
    sent, closed_at = [0] * len(conns), [None] * len(conns)
    sel = selectors.DefaultSelector()
    for i, (s, _) in enumerate(conns):
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, i)
    t0 = time.monotonic()
    while sel.get_map() and time.monotonic() - t0 < 30:
        for key, events in sel.select(1):
            i = key.data
            s, payload = conns[i]
            if events & selectors.EVENT_READ:
                try:
                    data = s.recv(1 << 16)
                except BlockingIOError:
                    data = None
                except OSError:
                    data = b""
                if data == b"":  # closed by the server
                    closed_at[i] = time.monotonic() - t0
                    sel.unregister(s)
                    s.close()
                    continue
                got[i] += data or b""
            if events & selectors.EVENT_WRITE:
                try:
                    sent[i] += s.send(payload[sent[i] : sent[i] + (1 << 16)])
                except BlockingIOError:
                    pass
                except OSError:  # the server stopped reading: what it answered is read
                    sent[i] = len(payload)
                if sent[i] >= len(payload):
                    sel.modify(s, selectors.EVENT_READ, i)
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return [(bytes(g), c) for g, c in zip(got, closed_at, strict=True)]


def refused_chunks(got: bytes, closed_at: float | None) -> bool:
    """Answered 4xx only (the app may answer first, a 429 or 422), the last answer 400
    `chunks_too_small`, and closed by the server."""
    statuses = [int(x) for x in re.findall(rb"HTTP/1.1 (\d{3}) ", got)]
    return (
        closed_at is not None
        and bool(statuses)
        and all(400 <= x < 500 for x in statuses)
        and re.search(rb'"code": ?"chunks_too_small"', got.rsplit(b"HTTP/1.1 ", 1)[-1]) is not None
    )


def _tiny_chunks(url: str, path: str, stop) -> dict:
    engine, anon = SidecarClient(f"unix://{path}"), SidecarClient(url)
    engine.put_namespace("eng", 4096)
    anon.put_namespace("anon", 4096)
    rounds, out, keys = 0, [], []
    while not stop.is_set():
        out += tiny_chunk_round(path, url, f"r{rounds}-")
        keys.append(f"r{rounds}-")
        rounds += 1
    n = FLOODS_ENGINE + FLOODS_TCP
    stored = sum(
        engine.exists_each("eng", [f"{k}{i}" for i in range(FLOODS_ENGINE)]).count(True)
        + anon.exists_each("anon", [f"{k}{i}" for i in range(FLOODS_ENGINE, n)]).count(True)
        for k in keys
    )
    return {
        "rounds": rounds,
        "connections": len(out),
        "not_refused": sum(not refused_chunks(g, c) for g, c in out),
        "slowest_close_s": round(max((c or 99.0 for _, c in out), default=0), 2),
        "stored": stored,
    }


def tiny_chunks(t: Target, stop: threading.Event) -> dict:
    out = as_user(_tiny_chunks, t.url, t.socket, _shared_stop(stop))
    held = out["connections"] > 0 and out["not_refused"] == 0 and out["stored"] == 0
    return {"held": held, **out}


ATTACKS = [
    Attack(2, "fd_on_http_engine_socket", fd_on_http_socket, seconds=3.0),
    Attack(3, "head_48mib", huge_head, seconds=6.0),
    Attack(6, "idle_tcp_1030", idle_tcp, seconds=8.0),
    Attack(6, "one_uid_1030_on_engine_socket", one_uid_engine_socket, seconds=5.0, token=None),
    Attack(
        10,
        "trickling_puts_64",
        trickling_puts,
        seconds=10.0,
        token=None,
        sidecar_args=("--read-timeout", "2", "--body-timeout", "5"),
    ),
    Attack(
        10,
        "unread_answers_64",
        unread_answers,
        seconds=5.0,
        token=None,
        sidecar_args=("--write-timeout", "2"),
    ),
    Attack(52, "tiny_chunks_both_listeners", tiny_chunks, seconds=5.0, token=None),
]
