"""Claims of the README and API.md that no test checked (issue 18): /readyz during recovery,
client_disconnected, prefetch tickets (failed, expired), the write-back `dropped` counter,
and the 3FS and shm flags from the command line (rescan, --hf3fs-size, --shm-dir)."""

import asyncio
import hashlib
import http.client
import os
import threading

import pytest

from api.engine.client import SidecarClient, SidecarError
from api.engine.shm import page_first_chunks
from sidecar.tiers.file_tier import FileTier
from tests.conftest import Gate, engine_connection, wait_for

PAGE = 4096
# the write-back counter of pages evicted while the write queue was full (/v1/stats);
# another change may rename it or change what fills it: adjust here
DROPPED = ("write_queue", "dropped")


def data(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def _get(srv, path):
    """(status, body) of a GET on loopback TCP, no token."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.config.port, timeout=10)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def test_readyz_is_503_until_tiers_are_recovered(make_server, monkeypatch, tmp_path):
    """Recovery of the tiers held on an event: alive (/healthz) but not ready (/readyz 503)."""
    gate = Gate(FileTier, "recover", monkeypatch.setattr)
    srv = make_server(file_tier=True, data_dir=str(tmp_path / "d"))
    try:
        assert gate.entered.wait(10)
        c = srv.tcp_client()
        assert not c.ready()
        status, body = _get(srv, "/readyz")
        assert status == 503 and b"not_ready" in body
        assert _get(srv, "/healthz")[0] == 200  # alive, not ready
    finally:
        gate.open()
    wait_for(lambda: _get(srv, "/readyz")[0] == 200, timeout=10)


def test_client_disconnected_mid_body_aborts_the_reservation(server, client):
    client.put_namespace("kv", PAGE)
    sock = engine_connection(server)
    sock.sendall(
        (
            f"PUT /v1/namespaces/kv/pages/cut HTTP/1.1\r\nHost: x\r\nContent-Length: {PAGE}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data("cut")[:100]
    )
    assert client.health()["status"] == "ok"  # the head was read (the loop answered after it)
    sock.close()
    line = (
        'kv_sidecar_requests_total{method="PUT",route="/v1/namespaces/{name}/pages/{key}",'
        'status="400"} 1.0'
    )
    wait_for(lambda: line in client.metrics(), timeout=10)  # answered client_disconnected
    assert client.exists("kv", ["cut"]) == 0
    server.invariants()
    assert client.put_page("kv", "cut", data("cut")) is True  # nothing left reserved under it
    assert client.get_page("kv", "cut") == data("cut")


def test_prefetch_ticket_reports_a_failed_promotion(server, client, monkeypatch):
    client.put_namespace("kv", PAGE)
    client.put_page("kv", "a", data("a"))
    tiering = server.ctx.store.tiering

    async def broken(*args):
        raise OSError("the tier went away")

    monkeypatch.setattr(tiering, "promote", broken)  # a fault injected on purpose
    ticket = client.request("POST", "/v1/namespaces/kv/prefetch", {"keys": ["a"]})[1]
    assert ticket["pages"] == 1
    path = f"/v1/prefetch/{ticket['ticket']}"
    wait_for(lambda: client.request("GET", path)[1]["state"] != "running", timeout=10)
    state = client.request("GET", path)[1]
    assert state["state"] == "failed" and "the tier went away" in state["error"]
    assert client.get_page("kv", "a") == data("a")  # the sidecar keeps serving


def test_prefetch_tickets_expire_oldest_first(server, client):
    """At most 4,096 tickets are kept: the oldest is forgotten (404 ticket_not_found)."""
    client.put_namespace("kv", PAGE)
    store = server.ctx.store

    async def many():
        ref = server.ns("kv").ref
        return [(await store.prefetch(ref, []))["ticket"] for _ in range(4097)]

    tickets = asyncio.run_coroutine_threadsafe(many(), server.ctx.loop).result(30)
    with pytest.raises(SidecarError) as exc:
        client.request("GET", f"/v1/prefetch/{tickets[0]}")
    assert exc.value.status == 404 and exc.value.code == "ticket_not_found"
    wait_for(lambda: client.request("GET", f"/v1/prefetch/{tickets[-1]}")[1]["state"] == "done")
    assert client.request("GET", f"/v1/prefetch/{tickets[1]}")[0] == 200


def test_write_back_keeps_pages_a_full_queue_cannot_take(make_server, tmp_path):
    """write_back with the queue full (one page, its write held): an eviction that cannot
    queue its page keeps it, the PUT that needs the slot waits (back-pressure), and the
    `dropped` counter stays 0; once the write ends every acknowledged page is kept."""
    srv = make_server(
        file_tier=True, data_dir=str(tmp_path / "d"), write_policy="write_back", write_queue_pages=1
    )
    c = srv.client(timeout=60)
    wait_for(c.ready)
    gate = Gate(srv.ctx.store.tiering.tiers[0], "write_batch")
    done = []
    try:
        c.put_namespace("small", PAGE, host_capacity_bytes=2 * PAGE)
        for k in "abc":
            c.put_page("small", k, data(k))  # c evicts a: queued, its write held
        assert gate.entered.wait(10)
        writer = threading.Thread(
            target=lambda: done.append(
                [srv.client(timeout=60).put_page("small", k, data(k)) for k in "de"]
            )
        )
        writer.start()
        # d needs a slot: b and c are in no tier and the queue is full, so d waits
        wait_for(lambda: srv.on_loop(lambda: srv.ctx.store.tiering.writer.full))
        assert srv.on_loop(lambda: sorted(srv.ns("small").pool.ready)) == ["b", "c"]
        assert not done
        stats = c.stats()
        assert stats[DROPPED[0]][DROPPED[1]] == 0, stats["write_queue"]
    finally:
        gate.open()
    writer.join(60)
    assert not writer.is_alive() and done == [[True, True]]
    c.request("POST", "/v1/flush")
    assert c.exists_each("small", list("abcde")) == [True] * 5
    assert c.stats()[DROPPED[0]][DROPPED[1]] == 0
    srv.invariants()


@pytest.mark.slow
def test_hf3fs_and_shm_flags_from_the_command_line(spawn, make_server, tmp_path):
    """--hf3fs-size caps this node's view, --hf3fs-rescan picks up pages another node
    published (no request asks for them), --shm-dir decides where path buffers may live."""
    shared, shm = tmp_path / "3fs", tmp_path / "shm"
    shm.mkdir()
    p = spawn(
        "--host-pool",
        "32MiB",
        "--no-file-tier",
        "--hf3fs-dir",
        str(shared),
        "--hf3fs-size",
        "64KiB",
        "--hf3fs-rescan",
        "0.2",
        "--shm-dir",
        str(shm),
    ).wait_ready()
    c = SidecarClient(p.socket_url)
    c.put_namespace("kv", PAGE, model="m")
    tier = lambda: c.stats()["tiers"]["hf3fs"]  # noqa: E731
    assert tier()["capacity"] == 64 * 1024 and tier()["pages"] == 0
    other = make_server(hf3fs_dir=str(shared), file_tier=False)  # another node
    oc = other.client()
    oc.put_namespace("kv", PAGE, model="m")
    oc.put_page("kv", "from-b", data("from-b"))
    oc.request("POST", "/v1/flush")
    wait_for(lambda: tier()["pages"] == 1, timeout=10)  # found by the rescan
    for i in range(30):
        c.put_page("kv", f"p{i}", data(f"p{i}"))
    c.request("POST", "/v1/flush")
    assert tier()["evictions"] > 0 and tier()["pages"] < 31  # the cap acts (see the next test)
    # a path buffer: inside --shm-dir it maps, /dev/shm is no longer allowed
    inside = shm / "buf"
    inside.write_bytes(bytes(2 * PAGE))
    assert c.register_buffer("kv", 2 * PAGE, 2, page_first_chunks(PAGE), path=str(inside))
    outside = f"/dev/shm/kv-claims-{os.getpid()}"
    with open(outside, "wb") as f:
        f.write(bytes(2 * PAGE))
    try:
        with pytest.raises(SidecarError) as exc:
            c.register_buffer("kv", 2 * PAGE, 2, page_first_chunks(PAGE), path=outside)
        assert 400 <= exc.value.status < 500
    finally:
        os.unlink(outside)


def test_hf3fs_size_is_a_hard_cap_under_rescans(make_server, tmp_path):
    srv = make_server(hf3fs_dir=str(tmp_path / "3fs"), hf3fs_size=64 * 1024, hf3fs_rescan=0.05)
    c = srv.client()
    c.put_namespace("kv", PAGE, model="m")
    for i in range(60):
        c.put_page("kv", f"p{i}", data(f"p{i}"))
    c.request("POST", "/v1/flush")
    tier = c.stats()["tiers"]["hf3fs"]
    assert tier["bytes"] <= 64 * 1024, tier
    on_disk = sum(f.stat().st_size for f in (tmp_path / "3fs").rglob("*") if f.is_file())
    assert 0 < on_disk <= 64 * 1024, on_disk  # the files, not only the index
    srv.invariants()
