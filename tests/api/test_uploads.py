"""Trickling inline uploads hold no more than their owner's part of the pool (issue 43,
item 6): an upload keeps its slot reserved while its body arrives, and a busy slot keeps
its whole segment from any reclaim, so uploads in flight are capped per owner (an eighth
of the segments, and its owner share: more than eight owners make it smaller) and in all
(half)."""

from __future__ import annotations

import os
import socket

import pytest

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.as_uid import as_user

PAGE = 1 << 20  # one page a segment: each upload in flight pins a segment
TENANTS = range(65500, 65508)  # eight uids (gid = uid): with TCP's and root's, ten owners
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="other uids need root")


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


def hold(srv, name: str, n: int) -> tuple[list[socket.socket], int]:
    """`n` stalled uploads into `name`: (the sockets of those held, how many got 429)."""
    held, refused = [], 0
    pool = srv.ns(name).pool
    for i in range(n):
        s = stalled_upload(srv, name, f"u{i}")
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
    return held, refused


def finish(held: list[socket.socket]) -> None:
    """The held uploads send the rest of their bodies: each is stored (201)."""
    for s in held:
        s.sendall(b"u" * (PAGE // 2))
        assert answer(s).startswith(b"HTTP/1.1 201")
        s.close()


def test_trickling_uploads_leave_another_owner_room(make_server):
    srv = make_server(host_pool=16 * PAGE, segment_size=PAGE, body_timeout=60, read_timeout=60)
    srv.tcp_client().put_namespace("hog", PAGE)  # anonymous TCP: alone, its share is the pool
    held, refused = hold(srv, "hog", 16)
    assert len(held) == 16 // 8 and refused == 16 - len(held)
    srv.invariants()
    victim = srv.client()  # the engine socket: another owner, arriving after the hog
    victim.put_namespace("kv", PAGE)
    buf = SharedBuffer(8 * PAGE)
    bid = buf.register(victim, "kv", 8, page_first_chunks(PAGE))
    keys = [f"k{i}" for i in range(8)]
    assert victim.set("kv", keys, bid, list(range(8))) == [True] * 8
    finish(held)  # the held uploads still finish
    srv.invariants()
    assert srv.on_loop(lambda: srv.ctx.store.ledger.uploads()) == 0


def _make_kv(url: str) -> None:
    SidecarClient(url).put_namespace("kv", PAGE)


@root_only
def test_an_uploader_holds_no_more_than_its_owner_share(make_server):
    """Ten owners share 16 segments: 1.6 each, under the eighth (2), so an owner's uploads
    in flight stop at one while another owner still uploads and stores."""
    srv = make_server(
        host_pool=16 * PAGE, segment_size=PAGE, body_timeout=60, read_timeout=60, socket_mode=0o666
    )
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    srv.tcp_client().put_namespace("hog", PAGE)
    for uid in TENANTS:
        as_user(_make_kv, srv.socket_url, uid=uid)
    victim = srv.client()  # root on the engine socket: the tenth owner
    victim.put_namespace("kv", PAGE)
    assert srv.on_loop(srv.ctx.host_pool.owner_share) == 16 / 10
    held, refused = hold(srv, "hog", 3)
    assert (len(held), refused) == (1, 2)  # its share's floor, not 16 // 8
    assert victim.put_page("kv", "k0", b"v" * PAGE)  # another owner's upload: stored
    assert victim.get_page("kv", "k0") == b"v" * PAGE
    finish(held)
    srv.invariants()
    assert srv.on_loop(lambda: srv.ctx.store.ledger.uploads()) == 0
