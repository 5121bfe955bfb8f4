"""Namespaces are bounded, and what the sidecar does once a second or per scrape does not
grow with them on the event loop (issue 26, item 11: 20,000 namespaces made the 1 s
sampler stall the loop 158 ms every second and each /metrics scrape 1.6 s)."""

import threading

import pytest

from api.engine.client import SidecarError
from sidecar import metrics, report, tenancy
from sidecar.peer import Peer
from sidecar.spec import parse_spec

PAGE = 4096


def test_namespaces_are_capped_per_owner_and_in_all(make_server, monkeypatch):
    monkeypatch.setattr(tenancy, "MAX_PER_OWNER", 8)
    monkeypatch.setattr(tenancy, "MAX_NAMESPACES", 12)
    srv = make_server()
    engine, tcp = srv.client(), srv.tcp_client()
    for i in range(8):
        engine.put_namespace(f"e{i}", PAGE)
    with pytest.raises(SidecarError) as e:
        engine.put_namespace("e8", PAGE)
    assert (e.value.status, e.value.code) == (
        429,
        "too_many_buffers",
    ) and "an owner" in e.value.message
    engine.put_namespace("e0", PAGE)  # an existing one is no new namespace
    for i in range(4):
        tcp.put_namespace(f"t{i}", PAGE)  # another owner (anonymous TCP): 12 in all
    with pytest.raises(SidecarError) as e:
        tcp.put_namespace("t4", PAGE)
    assert e.value.status == 429 and "namespaces, its limit" in e.value.message
    engine.delete_namespace("e0")
    tcp.put_namespace("t4", PAGE)  # room again
    srv.invariants()


def test_the_sampler_walks_no_namespace_counters(make_server, monkeypatch):
    srv = make_server()
    store = srv.ctx.store

    def made(n: int) -> None:
        for i in range(n):
            ns, _ = store.put_namespace(
                f"n{i}", parse_spec({"page_bytes": 512}), Peer(1, 1000 + i % 16, 1)
            )
            ns.pool.commit(ns.pool.reserve("k"))  # a page: the pool has capacity

    srv.on_loop(lambda: made(64))
    monkeypatch.setattr(report, "stats", lambda *a, **k: pytest.fail("the sampler walked stats()"))
    sample = srv.on_loop(lambda: report.sample(store))
    assert len(sample["fill"]) == report.FILL_TOP and set(sample["totals"]) >= {"hits", "misses"}
    srv.ctx.sampler.add(sample)  # what the 1 s task does with it


def test_a_scrape_renders_off_the_event_loop(make_server, monkeypatch):
    srv = make_server()
    srv.client().put_namespace("kv", PAGE)
    threads = []
    real = metrics.render

    def spy(snap):
        threads.append(threading.current_thread())
        return real(snap)

    monkeypatch.setattr("api.routes_health.render", spy)
    text = srv.client().metrics()
    assert 'kv_sidecar_hits_total{namespace="kv"}' in text
    assert threads and threads[0] is not srv.thread  # the server's loop runs in srv.thread
