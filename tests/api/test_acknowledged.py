"""Acknowledged means kept under the default write_through (issue 26, item 1).

A page answered `true` is on the tiers' queue before it can be evicted, or the answer is
`false`; a flush counts every such page. Forced with tier writes held by an event (a Gate
around the real file tier's `write_batch`), a 4-page write queue and a 16-page namespace,
several engines setting at once: the old order (commit, then wait for room in the queue)
let another set evict a committed page before it was queued, and still answered true.
"""

import hashlib
import threading

from api.engine.shm import SharedBuffer, page_first_chunks
from tests.conftest import Gate, wait_for

PAGE = 16384
ENGINES, ROUNDS, BATCH = 4, 6, 4


def data(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def test_write_through_under_eviction_pressure_never_acks_an_unqueued_page(make_server, tmp_path):
    srv = make_server(file_tier=True, data_dir=str(tmp_path / "data"), write_queue_pages=4)
    wait_for(lambda: srv.ctx.ready)
    c = srv.client(timeout=60)
    c.put_namespace("kv", PAGE, host_capacity_bytes=16 * PAGE)
    tier = srv.ctx.store.tiering.tiers[0]
    gate = Gate(tier, "write_batch")
    writer = srv.ctx.store.tiering.writer
    ident = srv.ns("kv").identity
    acked, done, lock = [], [], threading.Lock()

    def engine(e: int) -> None:
        ce = srv.client(timeout=60)
        buf = SharedBuffer(BATCH * PAGE)
        bid = buf.register(ce, "kv", BATCH, page_first_chunks(PAGE))
        for r in range(ROUNDS):
            keys = [f"e{e}-r{r}-{j}" for j in range(BATCH)]
            for j, k in enumerate(keys):
                buf.view(j * PAGE, PAGE)[:] = data(k)
            got = ce.set("kv", keys, bid, list(range(BATCH)))
            with lock:
                acked.extend(k for k, ok in zip(keys, got, strict=True) if ok)
        with lock:
            done.append(e)

    threads = [threading.Thread(target=engine, args=(e,)) for e in range(ENGINES)]
    for t in threads:
        t.start()
    # every engine is either done or waiting on the writer: whatever could be evicted has been
    wait_for(lambda: gate.entered.is_set() and len(writer._waiters) + len(done) == ENGINES)

    def unqueued():  # on the loop: an acknowledged page in neither the queue nor the tier
        pool = srv.ns("kv").pool
        pool.invariants()
        return [k for k in list(acked) if not (writer.queued(ident, k) or tier.contains(ident, k))]

    assert srv.on_loop(unqueued) == []
    gate.open()
    for t in threads:
        t.join(60)
    assert acked, "no set was acknowledged"
    flushed = c.request("POST", "/v1/flush")[1]
    assert flushed["pending"] == 0 and flushed["failed"] == 0, flushed
    assert c.stats()["write_queue"]["dropped"] == 0
    missing = [k for k in acked if not tier.contains(ident, k)]
    assert missing == [], f"{len(missing)} of {len(acked)} acknowledged pages are in no tier"
    for k in acked:
        assert c.get_page("kv", k) == data(k)
    srv.invariants()
    assert srv.on_loop(lambda: srv.ctx.store.tiering.writing.get("kv", 0)) == 0
    assert writer.promised == 0
