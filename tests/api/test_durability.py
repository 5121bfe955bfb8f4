"""Acknowledged means kept, deletes stick (issue 11, items 1, 2 and the delete part of 8).

Tier writes are held in flight by an event (a wrapper around the real file tier's
`write_batch`), never by sleeps."""

import errno
import hashlib
import logging
import os
import threading

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from sidecar.tiers import pagefile
from tests.conftest import Gate, wait_for

PAGE = 16384


def data(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def tiered(make_server, tmp_path, **kw):
    srv = make_server(file_tier=True, data_dir=str(tmp_path / "data"), **kw)
    wait_for(lambda: srv.ctx.ready)
    return srv


def file_tier(srv):
    return srv.ctx.store.tiering.tiers[0]


def put(client, ns, keys):
    for k in keys:
        client.put_page(ns, k, data(k))


# -- 1. acknowledged means kept -------------------------------------------------------
def test_write_back_under_eviction_pressure_with_a_full_queue_loses_no_acknowledged_page(
    make_server, tmp_path
):
    """64 keys through 8 slots and a 4-page write queue while no tier write can finish: the
    sets wait for the writer (back-pressure) instead of dropping evicted pages."""
    srv = tiered(make_server, tmp_path, write_policy="write_back", write_queue_pages=4)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE, host_capacity_bytes=8 * PAGE)
    gate = Gate(file_tier(srv), "write_batch")
    writer = srv.ctx.store.tiering.writer
    ident = srv.ns("kv").identity
    buf = SharedBuffer(8 * PAGE)
    bid = buf.register(c, "kv", 8, page_first_chunks(PAGE))
    acked, answers = [], []

    def engine():
        for r in range(8):
            keys = [f"r{r}-{j}" for j in range(8)]
            for j, k in enumerate(keys):
                buf.view(j * PAGE, PAGE)[:] = data(k)
            got = c.set("kv", keys, bid, list(range(8)))
            answers.extend(got)
            acked.extend(k for k, ok in zip(keys, got, strict=True) if ok)

    t = threading.Thread(target=engine)
    t.start()
    wait_for(lambda: gate.entered.is_set() and writer.full)

    def kept():  # on the loop: every acknowledged key is in the host pool or queued
        pool = srv.ns("kv").pool
        pool.invariants()
        return [k for k in list(acked) if not (pool.contains(k) or writer.queued(ident, k))]

    assert srv.on_loop(kept) == []
    assert t.is_alive()  # 8 slots + 4 queued cannot hold 64 keys: the engine waits
    gate.open()
    t.join(30)
    assert answers == [True] * 64
    assert c.request("POST", "/v1/flush")[1] == {"pending": 0, "failed": 0}
    assert c.stats()["write_queue"]["dropped"] == 0
    assert all(c.exists_each("kv", acked)), "an acknowledged page was dropped"
    for k in acked:
        assert c.get_page("kv", k) == data(k)
    srv.invariants()


def test_sigterm_writes_every_dirty_write_back_page(spawn, tmp_path):
    args = (
        "--host-pool",
        "32MiB",
        "--data-dir",
        str(tmp_path / "data"),
        "--write-policy",
        "write_back",
    )
    p = spawn(*args).wait_ready()
    c = SidecarClient(p.socket_url, timeout=30)
    c.put_namespace("kv", PAGE, host_capacity_bytes=64 * PAGE)
    keys = [f"k{i}" for i in range(200)]  # 136 evicted (written back), 64 only in the host pool
    put(c, "kv", keys)
    assert c.stats()["namespaces"]["kv"]["pages"]["host"] == 64
    rc, out = p.terminate()
    assert rc == 0 and "every page is written to the tiers" in out, out[-2000:]
    q = spawn(*args).wait_ready()
    cq = SidecarClient(q.socket_url, timeout=30)
    cq.put_namespace("kv", PAGE, host_capacity_bytes=64 * PAGE)
    assert cq.stats()["namespaces"]["kv"]["pages"] == {"host": 0, "file": 200}
    for k in keys:
        assert cq.get_page("kv", k) == data(k), k


class Lines(logging.Handler):
    def __init__(self, needle):
        super().__init__()
        self.needle, self.seen, self.lines = needle, threading.Event(), []

    def emit(self, record):
        msg = record.getMessage()
        self.lines.append(msg)
        if self.needle in msg:
            self.seen.set()


def test_a_shutdown_timeout_too_short_logs_how_many_pages_were_not_written(make_server, tmp_path):
    srv = tiered(make_server, tmp_path, write_policy="write_back", shutdown_timeout=0.3)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    put(c, "kv", [f"k{i}" for i in range(8)])  # dirty: in the host pool only
    gate = Gate(file_tier(srv), "write_batch")
    lines = Lines("pages not written")
    logging.getLogger("kv_sidecar").addHandler(lines)
    try:
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        assert lines.seen.wait(30), lines.lines
        gate.open()
        stopper.join(30)
    finally:
        logging.getLogger("kv_sidecar").removeHandler(lines)
    said = [m for m in lines.lines if "pages not written" in m]
    assert said[0].startswith("shutdown: 8 pages not written"), said


# -- 2. deletes stick ---------------------------------------------------------------------
def test_a_delete_during_a_held_write_sticks_across_flush_and_restart(make_server, tmp_path):
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    gate = Gate(file_tier(srv), "write_batch")
    put(c, "kv", ["a", "b", "c", "keep"])  # "a" is in flight, the rest queued behind it
    assert gate.entered.wait(10)
    answers = []
    deleter = threading.Thread(
        target=lambda: answers.append(
            c.request("POST", "/v1/namespaces/kv/delete", {"keys": ["a", "b", "c"]})[1]
        )
    )
    deleter.start()
    pool = srv.ns("kv").pool
    wait_for(lambda: not pool.contains("a"))  # the delete is past its cancel, awaiting "a"
    assert not answers  # it waits for the write in flight
    gate.open()
    deleter.join(30)
    assert answers == [{"deleted": 3, "failed": 0}]
    assert c.request("POST", "/v1/flush")[1] == {"pending": 0, "failed": 0}
    assert c.exists_each("kv", ["a", "b", "c", "keep"]) == [False, False, False, True]
    srv.stop()
    again = tiered(make_server, tmp_path)
    c2 = again.client(timeout=30)
    c2.put_namespace("kv", PAGE)
    assert c2.exists_each("kv", ["a", "b", "c", "keep"]) == [False, False, False, True]


def test_a_deleted_namespace_leaves_nothing_for_one_created_again(make_server, tmp_path):
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    ident = c.put_namespace("kv", PAGE)["identity"]
    put(c, "kv", ["x"])
    c.request("POST", "/v1/flush")
    gate = Gate(file_tier(srv), "write_batch")
    keys = [f"k{i}" for i in range(32)]
    put(c, "kv", keys)  # one batch in flight, the rest queued
    assert gate.entered.wait(10)
    answers = []
    deleter = threading.Thread(
        target=lambda: answers.append(c.request("DELETE", "/v1/namespaces/kv")[1])
    )
    deleter.start()
    wait_for(lambda: "kv" not in srv.ctx.store.dir.by_name)
    gate.open()
    deleter.join(30)
    assert answers == [{"deleted": "kv", "failed": 0}]
    assert c.request("POST", "/v1/flush")[1] == {"pending": 0, "failed": 0}
    assert not os.path.exists(tmp_path / "data" / ident)
    c.put_namespace("kv", PAGE)
    assert c.exists("kv", ["x"] + keys) == 0
    assert c.stats()["namespaces"]["kv"]["pages"] == {"host": 0, "file": 0}
    srv.invariants()


# -- 8. a delete the tier cannot perform ----------------------------------------------------
def test_a_delete_the_tier_refuses_is_answered_as_failed(make_server, tmp_path, monkeypatch):
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    put(c, "kv", ["a", "b"])
    c.request("POST", "/v1/flush")

    def refuse(path):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(pagefile, "remove", refuse)
    assert c.request("POST", "/v1/namespaces/kv/delete", {"keys": ["a"]})[1] == {
        "deleted": 1,
        "failed": 1,
    }
    assert c.exists_each("kv", ["a"]) == [True]  # still in the tier, as the answer said
    assert c.stats()["tiers"]["file"]["delete_errors"] == 1
    assert c.request("DELETE", "/v1/namespaces/kv")[1] == {"deleted": "kv", "failed": 2}
    monkeypatch.undo()
    c.put_namespace("kv", PAGE)
    assert c.exists("kv", ["a", "b"]) == 2  # nothing came back silently "deleted"


def test_a_namespace_created_again_while_its_pages_go_keeps_its_new_pages(make_server, tmp_path):
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    gate = Gate(file_tier(srv), "write_batch")
    put(c, "kv", ["old"])
    assert gate.entered.wait(10)  # the old page's write is held
    threads, answers = [], []

    def run(fn):
        threads.append(threading.Thread(target=lambda: answers.append(fn())))
        threads[-1].start()

    run(lambda: c.request("DELETE", "/v1/namespaces/kv")[1])
    wait_for(lambda: "kv" not in srv.ctx.store.dir.by_name)
    c.put_namespace("kv", PAGE)  # the same spec, so the same identity
    run(lambda: c.put_page("kv", "new", data("new")))
    # the new page is reserved and waits for the old pages to go before it is published
    wait_for(lambda: "new" in srv.ns("kv").pool.entries)
    gate.open()
    for t in threads:
        t.join(30)
    assert {"deleted": "kv", "failed": 0} in answers
    assert c.request("POST", "/v1/flush")[1] == {"pending": 0, "failed": 0}
    assert c.stats()["namespaces"]["kv"]["pages"] == {"host": 1, "file": 1}
    srv.stop()
    again = tiered(make_server, tmp_path)
    c2 = again.client(timeout=30)
    c2.put_namespace("kv", PAGE)
    assert c2.exists_each("kv", ["old", "new"]) == [False, True]
    assert c2.get_page("kv", "new") == data("new")
