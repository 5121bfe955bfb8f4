"""Operators' controls (issue 47; sidecar/controls/): pin, unpin, evict and warm by keys
or by chain, through the HTTP API, under another tenant's load, across a restart."""

import hashlib
import os
import time

import pytest

from api.engine.client import SidecarClient, SidecarError
from loadtest.kit.as_uid import as_user
from loadtest.kit.calls import status
from sidecar import ledger
from tests.conftest import wait_for

PAGE = 16384
TOKEN = "op-t0ken"
B = 65532
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a tenant of another uid needs root")


def data(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def put(c, ns, keys):
    for k in keys:
        c.put_page(ns, k, data(k))


def post(c, path, body, ok=()):
    return c.request("POST", path, body, ok=ok)


def tiered(make_server, tmp_path, **kw):
    srv = make_server(file_tier=True, data_dir=str(tmp_path / "data"), **kw)
    wait_for(lambda: srv.ctx.ready)
    return srv


def test_pinned_pages_outlive_eviction_pressure_and_unpin_lets_them_go(make_server):
    srv = make_server(token=TOKEN)
    op = srv.tcp_client()
    op.put_namespace("kv", PAGE, host_capacity_bytes=8 * PAGE)
    keys = [f"k{i}" for i in range(4)]
    put(op, "kv", keys)
    got = post(op, "/v1/namespaces/kv/pin", {"keys": keys + ["absent"], "ttl": 600})[1]
    assert (got["pinned"], got["missing"]) == (4, 1)
    put(op, "kv", [f"x{i}" for i in range(40)])  # 40 pages through the 4 slots left
    pool = srv.ns("kv").pool
    assert srv.on_loop(lambda: [pool.contains(k) for k in keys]) == [True] * 4
    listed = op.request("GET", "/v1/namespaces/kv/pins")[1]
    assert sorted(p["key"] for p in listed["pins"]) == keys and listed["bytes"] == 4 * PAGE
    assert post(op, "/v1/namespaces/kv/unpin", {"keys": keys[:2]})[1]["unpinned"] == 2
    put(op, "kv", [f"y{i}" for i in range(40)])
    assert srv.on_loop(lambda: [pool.contains(k) for k in keys]) == [False, False, True, True]
    assert post(op, "/v1/namespaces/kv/unpin", {"all": True})[1]["unpinned"] == 2
    srv.invariants()


def test_a_pin_ends_at_its_ttl(make_server):
    srv = make_server()
    c = srv.client()
    c.put_namespace("kv", PAGE)
    put(c, "kv", ["a", "b"])
    post(c, "/v1/namespaces/kv/pin", {"keys": ["a"], "ttl": 5})
    post(c, "/v1/namespaces/kv/pin", {"keys": ["b"], "ttl": 500})
    ctl, loop = srv.ctx.store.controls, srv.ctx.loop
    assert srv.on_loop(lambda: ctl.expire(loop.time() + 6)) == 1  # the clock moved 6 s on
    assert [p["key"] for p in c.request("GET", "/v1/namespaces/kv/pins")[1]["pins"]] == ["b"]
    assert srv.on_loop(lambda: srv.ns("kv").pool.entries["a"].pins) == 0
    post(c, "/v1/namespaces/kv/pin", {"keys": ["b"], "ttl": 5000})  # renewed, not doubled
    assert srv.on_loop(
        lambda: (ctl.expire(loop.time() + 600), srv.ns("kv").pool.entries["b"].pins)
    ) == (0, 1)
    t0 = time.monotonic()
    for _ in range(1100):  # pin and unpin without end: the expiry buckets stay bounded
        post(c, "/v1/namespaces/kv/pin", {"keys": ["a"]})
        post(c, "/v1/namespaces/kv/unpin", {"keys": ["a"]})
    # an ended pin leaves its bucket at once; the seconds' heap holds one a second at most
    assert srv.on_loop(lambda: (sum(map(len, ctl._due.values())), ctl.live)) == (1, 1)
    assert srv.on_loop(lambda: len(ctl._seconds)) <= time.monotonic() - t0 + 3
    srv.invariants()


def test_pins_are_bounded_per_owner_and_take_no_other_owners_share(make_server):
    """64 segments of 1 MiB, two owners: each may pin 16 segments' worth (half its share of
    32). A pin past that is refused whole; the other owner then grows to its share by
    reclaiming the pinner's unpinned segments, never a pinned one."""
    srv = make_server(token=TOKEN)
    op, peer = srv.tcp_client(), srv.client()
    op.put_namespace("big", PAGE)
    peer.put_namespace("mine", PAGE)
    per_seg = 2**20 // PAGE
    put(op, "big", [f"b{i}" for i in range(64 * per_seg)])  # fills the host pool
    first = [f"b{i}" for i in range(0, 64 * per_seg, per_seg)]  # one page in each segment
    pool = srv.ns("big").pool
    first = srv.on_loop(lambda: [k for k in first if pool.contains(k)])
    err = pytest.raises(SidecarError, post, op, "/v1/namespaces/big/pin", {"keys": first[:17]})
    assert err.value.status == 507 and err.value.code == "pin_bound"
    assert op.request("GET", "/v1/namespaces/big/pins")[1]["pages"] == 0  # all or nothing
    got = post(op, "/v1/namespaces/big/pin", {"keys": first[:16]})[1]
    assert got["pinned"] == 16 and got["held_bytes"] == 16 * 2**20 == got["bound_bytes"]
    put(peer, "mine", [f"m{i}" for i in range(40 * per_seg)])  # the neighbour's load
    assert srv.on_loop(lambda: all(pool.contains(k) for k in first[:16]))
    mine = srv.ns("mine").pool
    assert srv.on_loop(lambda: len(mine.segments)) == 32  # its share, no more
    srv.invariants()


def test_an_owners_pins_over_a_shrunk_share_end_newest_first(make_server):
    srv = make_server()
    c = srv.client()
    c.put_namespace("kv", PAGE)
    per_seg = 2**20 // PAGE
    put(c, "kv", [f"k{i}" for i in range(8 * per_seg)])
    keys = [f"k{i}" for i in range(0, 8 * per_seg, per_seg)]
    post(c, "/v1/namespaces/kv/pin", {"keys": keys})
    ctl = srv.ctx.store.controls
    srv.on_loop(lambda: setattr(ledger, "PIN_SHARE", 4 / 64))  # as if 15 owners came
    try:
        assert srv.on_loop(ctl.enforce) == 4
    finally:
        ledger.PIN_SHARE = 0.5
    left = [p["key"] for p in c.request("GET", "/v1/namespaces/kv/pins")[1]["pins"]]
    assert left == keys[:4]
    srv.invariants()


def test_evict_a_chain_from_a_key_on_from_every_tier_sticks_across_a_restart(make_server, tmp_path):
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    chain = [f"c{i}" for i in range(12)]
    put(c, "kv", chain + ["other"])
    post(c, "/v1/namespaces/kv/pin", {"keys": chain[6:8]})  # a pin does not save it
    assert c.request("POST", "/v1/flush")[1]["pending"] == 0
    got = post(c, "/v1/namespaces/kv/evict", {"chain": chain + ["c99"], "from": "c4"})[1]
    assert got == {"deleted": 8, "failed": 0}
    want = [True] * 4 + [False] * 8 + [True]
    assert c.exists_each("kv", chain + ["other"]) == want
    assert c.request("GET", "/v1/namespaces/kv/pins")[1]["pages"] == 0
    srv.invariants()
    srv.stop()
    again = tiered(make_server, tmp_path)
    c2 = again.client(timeout=30)
    c2.put_namespace("kv", PAGE)
    assert c2.exists_each("kv", chain + ["other"]) == want
    assert c2.stats()["namespaces"]["kv"]["pages"] == {"host": 0, "file": 5}


def test_warm_brings_a_chain_back_from_the_file_tier_after_a_restart(make_server, tmp_path):
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    chain = [f"w{i}" for i in range(200)]
    put(c, "kv", chain)
    assert c.request("POST", "/v1/flush")[1]["pending"] == 0
    srv.stop()
    again = tiered(make_server, tmp_path)
    c2 = again.client(timeout=30)
    c2.put_namespace("kv", PAGE)
    post(c2, "/v1/namespaces/kv/delete", {"keys": ["w150"]})  # a hole: the chain ends there
    job = post(c2, "/v1/namespaces/kv/warm", {"chain": chain, "from": "w10"})[1]
    assert job["pages"] == 140
    wait_for(lambda: c2.request("GET", f"/v1/warm/{job['job']}")[1]["state"] != "running")
    state = c2.request("GET", f"/v1/warm/{job['job']}")[1]
    assert (state["state"], state["done"], state["loaded"]) == ("done", 140, 140)
    assert c2.stats()["namespaces"]["kv"]["pages"]["host"] == 140
    assert [j["job"] for j in c2.stats()["controls"]["warm"]] == [job["job"]]
    assert c2.get_page("kv", "w10") == data("w10")
    again.invariants()


def test_selection_errors_are_400s_and_a_huge_chain_413(make_server):
    srv = make_server()
    c = srv.client()
    c.put_namespace("kv", PAGE)
    bad = [
        {},
        {"keys": "k"},
        {"chain": ["a"], "from": "b"},
        {"keys": ["a"], "ttl": 0},
        {"keys": ["a"], "ttl": True},
        {"chain": ["a b"]},
    ]
    for body in bad:
        assert status(lambda body=body: post(c, "/v1/namespaces/kv/pin", body)) == 400, body
    huge = {"chain": [f"k{i}" for i in range(4097)]}
    for verb in ("pin", "evict", "warm", "unpin"):
        assert status(lambda verb=verb: post(c, f"/v1/namespaces/kv/{verb}", huge)) == 413
    assert status(lambda: c.request("GET", "/v1/warm/w-nope")) == 404
    assert status(lambda: post(c, "/v1/namespaces/nope/pin", {"keys": ["a"]})) == 404


def _tenant_b(url: str) -> dict:
    """What tenant B gets on A's namespaces: 'kv' (private: absent) and 'team' (shared)."""
    c = SidecarClient(url, token=TOKEN)
    c.put_namespace("team", PAGE, share_gid=B)  # a member joins the shared one
    out = {}
    for ns in ("kv", "team"):
        for verb in ("pin", "unpin", "evict", "warm"):
            out[f"{verb} {ns}"] = status(
                lambda ns=ns, verb=verb: post(c, f"/v1/namespaces/{ns}/{verb}", {"keys": ["k"]})
            )
        out[f"pins {ns}"] = status(lambda ns=ns: c.request("GET", f"/v1/namespaces/{ns}/pins"))
    return out


@root_only
def test_a_tenant_cannot_pin_evict_or_warm_another_owners_namespace(make_server, tmp_path):
    srv = tiered(make_server, tmp_path, socket_mode=0o666, token=TOKEN)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    a = srv.client()
    a.put_namespace("kv", PAGE)
    as_user(
        lambda url: SidecarClient(url, token=TOKEN).put_namespace("team", PAGE, share_gid=B),
        srv.socket_url,
        uid=0,
        groups=[0, B],
    )  # root in B's group: a member may share
    put(a, "kv", ["k"])
    put(a, "team", ["k"])
    post(a, "/v1/namespaces/kv/pin", {"keys": ["k"]})
    got = as_user(_tenant_b, srv.socket_url, uid=B)
    assert {k: v for k, v in got.items() if k.endswith(" kv")} == {
        "pin kv": 404,
        "unpin kv": 404,
        "evict kv": 404,
        "warm kv": 404,
        "pins kv": 404,
    }
    assert {k: v for k, v in got.items() if k.endswith(" team")} == {
        "pin team": 403,
        "unpin team": 403,
        "evict team": 403,
        "warm team": 403,
        "pins team": 200,
    }
    assert a.exists_each("kv", ["k"]) == [True] and a.exists_each("team", ["k"]) == [True]
    assert a.request("GET", "/v1/namespaces/kv/pins")[1]["pages"] == 1
    op = srv.tcp_client()  # the operator: any
    assert post(op, f"/v1/namespaces/kv@{os.getuid()}/evict", {"keys": ["k"]})[1]["deleted"] == 1


def test_a_pinned_page_no_tier_holds_is_written_first(make_server, tmp_path):
    srv = tiered(make_server, tmp_path, write_policy="write_back")
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    put(c, "kv", ["a", "b", "c"])  # write-back: in the host pool only
    tier, ident = srv.ctx.store.tiering.tiers[0], srv.ns("kv").identity
    assert not any(tier.contains(ident, k) for k in "abc")
    assert post(c, "/v1/namespaces/kv/pin", {"keys": ["a", "b"]})[1]["queued_for_tiers"] == 2
    wait_for(lambda: tier.contains(ident, "a") and tier.contains(ident, "b"))
    assert not tier.contains(ident, "c")
    srv.invariants()


def test_controls_hold_under_another_tenants_load(make_server, tmp_path):
    """A neighbour stores pages without pause while the operator warms, pins and evicts a
    chain of its own: every answer is what it would be alone."""
    import threading

    srv = tiered(make_server, tmp_path, token=TOKEN)
    op, peer = srv.tcp_client(timeout=30), srv.client(timeout=30)
    op.put_namespace("kv", PAGE, host_capacity_bytes=64 * PAGE)
    peer.put_namespace("theirs", PAGE)
    chain = [f"c{i}" for i in range(128)]  # half of it evicted to the file tier
    put(op, "kv", chain)
    assert op.request("POST", "/v1/flush")[1]["pending"] == 0
    stop, stored = threading.Event(), []

    def load():
        i = 0
        while not stop.is_set():
            peer.put_page("theirs", f"t{i}", data(f"t{i}"))
            stored.append(i)
            i += 1

    t = threading.Thread(target=load)
    t.start()
    try:
        job = post(op, "/v1/namespaces/kv/warm", {"chain": chain[:32]})[1]
        wait_for(lambda: op.request("GET", f"/v1/warm/{job['job']}")[1]["state"] == "done")
        assert post(op, "/v1/namespaces/kv/pin", {"chain": chain[:32]})[1]["pinned"] == 32
        assert post(op, "/v1/namespaces/kv/evict", {"chain": chain, "from": "c100"})[1] == {
            "deleted": 28,
            "failed": 0,
        }
    finally:
        stop.set()
        t.join(30)
    assert stored and op.exists_each("kv", ["c0", "c31", "c99", "c100"]) == [True] * 3 + [False]
    pool = srv.ns("kv").pool
    assert srv.on_loop(lambda: all(pool.contains(k) for k in chain[:32]))
    srv.invariants()


def test_what_a_cached_token_costs_is_in_cost_stats_and_metrics(make_server):
    srv = make_server(token=TOKEN)
    op, peer = srv.tcp_client(), srv.client()
    op.put_namespace("kv", PAGE, page_tokens=16)
    peer.put_namespace("mine", PAGE)
    put(op, "kv", [f"k{i}" for i in range(1000)])
    put(peer, "mine", ["m"])
    got = op.request("GET", "/v1/cost")[1]
    node, kv = got["node"], got["namespaces"]["kv"]
    assert (node["pages"], node["tokens"], node["nominal_bytes"]) == (1001, 16000, 64 * 2**20)
    assert node["per_page"]["host_bytes"] == round(64 * 2**20 / 1001, 1)
    assert 100 < node["per_page"]["index_bytes"] < 2000  # an Entry, a key, dict slots
    assert node["rss_bytes"] > node["nominal_bytes"]  # the arena is resident whole
    assert kv["slot_bytes"] == PAGE and kv["page_tokens"] == 16
    assert kv["bytes_per_token"] == round((PAGE + kv["index_bytes"] / 1000) / 16, 1)
    assert op.stats()["cost"]["node"]["pages"] == 1001
    mine = peer.request("GET", "/v1/cost")[1]  # a tenant: its own pages
    assert list(mine["namespaces"]) == ["mine"] and mine["node"]["pages"] == 1
    text = op.metrics()
    assert 'kv_sidecar_cost_bytes{kind="index",per="page"}' in text
    assert "kv_sidecar_rss_bytes " in text and "kv_sidecar_index_bytes " in text
