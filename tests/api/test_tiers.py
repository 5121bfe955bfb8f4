"""Durable tiers end to end: restart, promotion, prefetch, flush, policies, faults, SIGKILL,
and two sidecars sharing one 3FS directory."""

import hashlib
import threading
import time

import pytest

from api.engine.client import SidecarClient, SidecarError, SidecarUnavailable
from api.engine.shm import SharedBuffer, page_first_chunks

PAGE = 16384


def data(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def start(spawn, tmp_path, *extra, pool="32MiB"):
    return spawn(
        "--host-pool", pool, "--data-dir", str(tmp_path / "data"), "--log-level", "warning", *extra
    ).wait_ready()


def client_for(proc):
    return SidecarClient(proc.socket_url, timeout=30)


@pytest.mark.slow
def test_restart_serves_flushed_pages_and_promotes_them(spawn, tmp_path):
    p = start(spawn, tmp_path)
    c = client_for(p)
    c.put_namespace("kv", PAGE, model="m")
    buf = SharedBuffer(16 * PAGE)
    for i in range(16):
        buf.view(i * PAGE, PAGE)[:] = data(f"k{i}")
    bid = buf.register(c, "kv", 16, page_first_chunks(PAGE))
    keys = [f"k{i}" for i in range(16)]
    assert c.set("kv", keys, bid, list(range(16))) == [True] * 16
    assert c.request("POST", "/v1/flush")[1] == {"pending": 0, "failed": 0}
    assert c.stats()["namespaces"]["kv"]["pages"] == {"host": 16, "file": 16}
    assert p.terminate()[0] == 0

    p2 = start(spawn, tmp_path)
    c2 = client_for(p2)
    c2.put_namespace("kv", PAGE, model="m")
    assert c2.stats()["namespaces"]["kv"]["pages"] == {"host": 0, "file": 16}
    assert c2.exists("kv", keys + ["nope"]) == 16  # answered from the tier's index
    out = SharedBuffer(16 * PAGE)
    oid = out.register(c2, "kv", 16, page_first_chunks(PAGE))
    assert c2.get("kv", keys, oid, list(range(16))) == [True] * 16
    assert all(out.view(i * PAGE, PAGE) == data(k) for i, k in enumerate(keys))
    stats = c2.stats()["namespaces"]["kv"]
    assert stats["pages"]["host"] == 16 and stats["tier_hits"] == 16
    assert c2.get_page("kv", "k3") == data("k3")
    # another spec (other model) never sees these pages
    c2.put_namespace("other", PAGE, model="m2")
    assert c2.exists("other", keys) == 0


@pytest.mark.slow
def test_prefetch_delete_and_namespace_drop(spawn, tmp_path):
    p = start(spawn, tmp_path)
    c = client_for(p)
    c.put_namespace("kv", PAGE)
    for k in ("a", "b", "c"):
        c.put_page("kv", k, data(k))
    c.request("POST", "/v1/flush")
    p.terminate()
    p2 = start(spawn, tmp_path)
    c2 = client_for(p2)
    c2.put_namespace("kv", PAGE)
    t = c2.request("POST", "/v1/namespaces/kv/prefetch", {"keys": ["a", "b", "x", "c"]})[1]
    assert t["pages"] == 2
    deadline = time.time() + 10
    while (state := c2.request("GET", f"/v1/prefetch/{t['ticket']}")[1])["state"] == "running":
        assert time.time() < deadline
        time.sleep(0.02)
    assert state == {"state": "done", "done": 2, "pages": 2}
    assert c2.stats()["namespaces"]["kv"]["pages"]["host"] == 2
    with pytest.raises(SidecarError) as exc:
        c2.request("GET", "/v1/prefetch/t-unknown")
    assert exc.value.status == 404
    assert c2.delete("kv", ["a", "c", "zz"]) == 2
    assert c2.exists_each("kv", ["a", "b", "c"]) == [False, True, False]
    c2.delete_namespace("kv")
    c2.put_namespace("kv", PAGE)
    assert c2.exists("kv", ["b"]) == 0  # a deleted namespace's pages are gone from every tier


@pytest.mark.slow
def test_write_back_writes_evicted_pages_and_none_writes_nothing(spawn, tmp_path):
    p = start(spawn, tmp_path, "--write-policy", "write_back")
    c = client_for(p)
    c.put_namespace("kv", PAGE, host_capacity_bytes=4 * PAGE)
    for i in range(10):
        c.put_page("kv", f"k{i}", data(f"k{i}"))
    c.request("POST", "/v1/flush")
    tiers = c.stats()["namespaces"]["kv"]["pages"]
    assert tiers["host"] == 4 and tiers["file"] == 10  # six evicted, four written by the flush
    assert c.exists("kv", [f"k{i}" for i in range(10)]) == 10  # every page, some tier
    assert c.get_page("kv", "k0") == data("k0")
    p.terminate()
    q = start(spawn, tmp_path / "other", "--write-policy", "none")
    cq = client_for(q)
    cq.put_namespace("kv", PAGE)
    cq.put_page("kv", "a", data("a"))
    assert cq.request("POST", "/v1/flush")[1]["pending"] == 0
    assert cq.stats()["namespaces"]["kv"]["pages"] == {"host": 1, "file": 0}


def test_tier_failure_answers_false_for_durable_sets_and_keeps_serving(spawn, tmp_path):
    """The data directory becomes unwritable (a file where a directory must be): like ENOSPC
    or a vanished mount, writes fail; durable sets say false, the host pool still serves."""
    p = start(spawn, tmp_path)
    c = client_for(p)
    c.put_namespace("kv", PAGE)
    ident = c.get_namespace("kv")["identity"]
    blocker = tmp_path / "data" / ident
    blocker.write_bytes(b"not a directory")
    buf = SharedBuffer(2 * PAGE)
    buf.view(0, PAGE)[:] = data("a")
    bid = buf.register(c, "kv", 2, page_first_chunks(PAGE))
    body = {"keys": ["a"], "buffer_id": bid, "slots": [0], "durable": True}
    assert c.request("POST", "/v1/namespaces/kv/set", body)[1] == {"stored": [False]}
    assert c.get_page("kv", "a") == data("a")  # still served from the host pool
    stats = c.stats()
    assert stats["tiers"]["file"]["write_errors"] >= 1 and stats["tiers"]["file"]["degraded"]
    assert stats["write_queue"]["failed"] >= 1
    assert "kv_sidecar" in c.metrics()
    blocker.unlink()  # the disk comes back
    buf.view(PAGE, PAGE)[:] = data("b")
    body = {"keys": ["b"], "buffer_id": bid, "slots": [1], "durable": True}
    assert c.request("POST", "/v1/namespaces/kv/set", body)[1] == {"stored": [True]}
    assert p.terminate()[0] == 0


@pytest.mark.slow
def test_sigkill_during_write_through_loses_nothing_flushed(spawn, tmp_path):
    p = start(spawn, tmp_path, pool="64MiB")
    c = client_for(p)
    c.put_namespace("kv", PAGE)
    acked, lock, stop = set(), threading.Lock(), threading.Event()
    written = []

    def writer(w):
        cl = SidecarClient(p.socket_url, timeout=5)
        i = 0
        while not stop.is_set():
            key = f"w{w}-{i}"
            try:
                cl.put_page("kv", key, data(key))
            except (SidecarUnavailable, SidecarError):
                return
            with lock:
                written.append(key)
            i += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    fc = SidecarClient(p.socket_url, timeout=30)
    for _ in range(4):
        time.sleep(0.3)
        with lock:
            before = list(written)
        if fc.request("POST", "/v1/flush", ok=(504,))[0] == 200:
            acked.update(before)  # every page stored before the flush call is durable
    p.kill()  # SIGKILL in the middle of heavy write-through
    stop.set()
    for t in threads:
        t.join(10)
    assert len(acked) > 50

    p2 = start(spawn, tmp_path, pool="64MiB")
    c2 = client_for(p2)
    c2.put_namespace("kv", PAGE)
    acked_list = sorted(acked)
    for i in range(0, len(acked_list), 512):
        chunk = acked_list[i : i + 512]
        assert all(c2.exists_each("kv", chunk)), "a flushed page was lost"
    for key in written:  # flushed or not: a page that comes back is byte-exact
        page = c2.get_page("kv", key)
        assert page is None or page == data(key), f"{key} came back with wrong bytes"
        if key in acked:
            assert page == data(key)


@pytest.mark.slow
def test_two_sidecars_share_one_hf3fs_directory(spawn, tmp_path):
    shared = str(tmp_path / "3fs")
    a = spawn("--host-pool", "32MiB", "--no-file-tier", "--hf3fs-dir", shared).wait_ready()
    b = spawn("--host-pool", "32MiB", "--no-file-tier", "--hf3fs-dir", shared).wait_ready()
    ca, cb = client_for(a), client_for(b)
    for c in (ca, cb):
        c.put_namespace("kv", PAGE, model="m")
        c.put_namespace("kv2", PAGE, model="m", dtype="fp8")  # another spec, same key
    ca.put_page("kv", "k", data("k"))
    ca.put_page("kv2", "k", data("other"))
    ca.request("POST", "/v1/flush")
    deadline = time.time() + 5  # B reads A's index log every 0.1 s (a new log: within 1 s)
    while cb.exists("kv", ["k"]) != 1 and time.time() < deadline:
        time.sleep(0.02)
    assert cb.exists("kv", ["k"]) == 1  # written on node A, a hit on B
    assert cb.get_page("kv", "k") == data("k")
    assert cb.get_page("kv2", "k") == data("other")  # specs never collide
    b.terminate()
    b2 = spawn("--host-pool", "32MiB", "--no-file-tier", "--hf3fs-dir", shared).wait_ready()
    cb2 = client_for(b2)
    cb2.put_namespace("kv", PAGE, model="m")
    assert cb2.get_page("kv", "k") == data("k")  # after B restarts
    cb2.put_page("kv", "j", data("j"))
    cb2.request("POST", "/v1/flush")
    a.terminate()
    a2 = spawn("--host-pool", "32MiB", "--no-file-tier", "--hf3fs-dir", shared).wait_ready()
    ca2 = client_for(a2)
    ca2.put_namespace("kv", PAGE, model="m")
    assert ca2.exists("kv", ["k", "j"]) == 2 and ca2.get_page("kv", "j") == data("j")
