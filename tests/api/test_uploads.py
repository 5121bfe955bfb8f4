"""Trickling inline uploads hold no more than their owner's part of the pool (issue 43,
item 6): an upload keeps its slot reserved while its body arrives, and a busy slot keeps
its whole segment from any reclaim, so uploads in flight are capped per owner (an eighth
of the segments) and in all (half)."""

from __future__ import annotations

import socket

from api.engine.shm import SharedBuffer, page_first_chunks

PAGE = 1 << 20  # one page a segment: each upload in flight pins a segment


def stalled_upload(srv, name: str, key: str) -> socket.socket:
    """A PUT over loopback TCP (the anonymous tenant) that sends half its body and stops."""
    s = socket.create_connection(("127.0.0.1", srv.config.port), timeout=10)
    s.sendall(
        b"PUT /v1/namespaces/%s/pages/%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        % (name.encode(), key.encode(), PAGE)
        + b"u" * (PAGE // 2)
    )
    return s


def answer(s: socket.socket) -> bytes:
    try:
        return s.recv(4096)
    except TimeoutError:
        return b""
    except OSError:
        return b"closed"


def test_trickling_uploads_leave_another_owner_room(make_server):
    srv = make_server(host_pool=16 * PAGE, segment_size=PAGE, body_timeout=60, read_timeout=60)
    srv.tcp_client().put_namespace("hog", PAGE)  # anonymous TCP: alone, its share is the pool
    held, refused = [], 0
    pool = srv.ns("hog").pool
    for i in range(16):
        s = stalled_upload(srv, "hog", f"u{i}")
        s.settimeout(0.05)
        got = b""
        for _ in range(200):  # each upload is either held (its key reserved) or refused
            if srv.on_loop(lambda k=f"u{i}": k in pool.entries):
                break
            got = answer(s)
            if got:
                break
        if got:
            assert got.startswith(b"HTTP/1.1 429"), got[:64]
            refused += 1
            s.close()
        else:
            s.settimeout(10)
            held.append(s)
    assert len(held) == 16 // 8 and refused == 16 - len(held)
    srv.invariants()
    victim = srv.client()  # the engine socket: another owner, arriving after the hog
    victim.put_namespace("kv", PAGE)
    buf = SharedBuffer(8 * PAGE)
    bid = buf.register(victim, "kv", 8, page_first_chunks(PAGE))
    keys = [f"k{i}" for i in range(8)]
    assert victim.set("kv", keys, bid, list(range(8))) == [True] * 8
    for s in held:  # the held uploads still finish
        s.sendall(b"u" * (PAGE // 2))
        assert answer(s).startswith(b"HTTP/1.1 201")
        s.close()
    srv.invariants()
    assert srv.on_loop(lambda: sum(srv.ctx.store.uploads.values())) == 0
