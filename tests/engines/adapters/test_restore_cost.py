"""Never slower than recomputing (issue 44): the engine-side estimator
(api/engine/restore_cost.py), where the sidecar says a prefix lies (`exists` with
`where`), and the skipped restores an engine reports (`POST .../skipped`)."""

import hashlib
import os

import pytest

from api.engine.client import SidecarClient, SidecarError
from api.engine.restore_cost import HOST, LOCAL, REMOTE, RestoreCost, by_tier
from loadtest.kit.as_uid import as_user

PAGE = 4096
MiB = 1 << 20


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the estimator ----------------------------------------------------------------------
def test_cold_start_loads_and_learns_a_slow_tier():
    est = RestoreCost(alpha=1.0)
    assert est.worth(1000, {LOCAL: 8 * MiB})  # nothing measured: optimistic
    est.observe_prefill(1000, 0.1)  # 10,000 tokens/s
    assert est.worth(1000, {LOCAL: 8 * MiB})  # the tier is still unmeasured
    est.observe_restore({LOCAL: 8 * MiB}, 0.8)  # 10 MiB/s: 0.8 s against 0.1 s
    assert not est.worth(1000, {LOCAL: 8 * MiB})
    assert est.worth(1000, {HOST: 8 * MiB})  # another tier: its own estimate
    est.observe_restore({HOST: 8 * MiB}, 0.004)  # 2 GiB/s
    assert est.worth(1000, {HOST: 8 * MiB})
    assert not est.worth(10, {HOST: 8 * MiB})  # 1 ms of prefill: not worth 4 ms


def test_the_round_trip_counts_against_a_restore():
    est = RestoreCost(alpha=1.0)
    est.observe_prefill(1000, 0.1)  # 10,000 tokens/s: 100 us a token
    est.observe_rtt(0.005)
    est.observe_restore({HOST: 100 * MiB}, 0.105)  # 0.1 s beyond the round trip: 1 GiB/s
    assert est.snapshot()["bytes_per_s"][HOST] == pytest.approx(1000 * MiB)
    assert not est.worth(40, {HOST: 1024})  # 4 ms of prefill < 5 ms of round trip
    assert est.worth(60, {HOST: 1024})


def test_a_mixed_load_charges_its_slowest_tier():
    est = RestoreCost(alpha=1.0)
    est.observe_restore({HOST: 100 * MiB}, 0.1)  # host: 1,000 MiB/s
    est.observe_restore({HOST: 100 * MiB, REMOTE: 10 * MiB}, 1.1)
    rates = est.snapshot()["bytes_per_s"]
    assert rates[HOST] == pytest.approx(1000 * MiB)
    assert rates[REMOTE] == pytest.approx(10 * MiB)  # 1.0 s of the 1.1 s was the remote's


def test_choose_prefers_the_longest_prefix_worth_loading():
    est = RestoreCost(alpha=1.0)
    est.observe_prefill(10_000, 1.0)  # 100 us a token
    est.observe_restore({HOST: 64 * MiB}, 0.01)
    est.observe_restore({LOCAL: 64 * MiB}, 10.0)
    full = (800, by_tier(50, 25, 50, MiB))  # 25 host pages, 25 on the file tier
    host_part = (400, by_tier(25, 25, 50, MiB))
    assert est.choose([full, host_part]) == 400  # the host run loads, the rest computes
    assert est.choose([full]) == 0


def test_a_tier_judged_slow_is_probed_again():
    clock = Clock()
    est = RestoreCost(alpha=1.0, probe_s=60, clock=clock)
    est.observe_prefill(1000, 0.1)
    est.observe_restore({LOCAL: MiB}, 1.0)
    assert not est.worth(100, {LOCAL: MiB})
    clock.now = 59
    assert not est.worth(100, {LOCAL: MiB})
    clock.now = 61
    assert est.worth(100, {LOCAL: MiB})  # one probe
    assert not est.worth(100, {LOCAL: MiB})  # then judged again
    est.observe_restore({LOCAL: MiB}, 1.0)  # still slow: the next probe waits twice as long
    clock.now = 61 + 119
    assert not est.worth(100, {LOCAL: MiB})
    clock.now = 61 + 121
    assert est.worth(100, {LOCAL: MiB})
    est.observe_restore({LOCAL: MiB}, 0.001)  # the probe was fast: it recovered
    assert est.worth(100, {LOCAL: MiB})


def test_noise_and_nonsense_are_ignored():
    est = RestoreCost()
    est.observe_prefill(0, 1.0)
    est.observe_prefill(100, 0.0)
    est.observe_restore({"tape": MiB}, 1.0)
    est.observe_restore({HOST: 0}, 1.0)
    assert est.snapshot() == {
        "prefill_tokens_per_s": None,
        "rtt_s": None,
        "bytes_per_s": {HOST: None, LOCAL: None, REMOTE: None},
    }


def test_by_tier_splits_a_prefix():
    assert by_tier(10, 4, 7, 1) == {HOST: 4, LOCAL: 3, REMOTE: 3}
    assert by_tier(10, 4, 7, 1, start=5) == {HOST: 0, LOCAL: 2, REMOTE: 3}
    assert by_tier(10, 4, 7, 1, start=8) == {HOST: 0, LOCAL: 0, REMOTE: 2}
    assert by_tier(5, 10, 10, 2) == {HOST: 10, LOCAL: 0, REMOTE: 0}


# -- the sidecar's side -------------------------------------------------------------------
def page(tag: str) -> bytes:
    return hashlib.shake_256(tag.encode()).digest(PAGE)


def test_exists_where_tells_host_pool_from_file_tier(make_server, tmp_path):
    data = str(tmp_path / "data")
    srv = make_server(file_tier=True, data_dir=data)
    c = srv.client()
    c.put_namespace("kv", PAGE)
    keys = [f"k{i}" for i in range(6)]
    for k in keys[:4]:
        c.put_page("kv", k, page(k))
    assert c.request("POST", "/v1/flush")[1]["pending"] == 0
    srv.stop()
    srv = make_server(file_tier=True, data_dir=data)  # the same data dir: pages on the tier only
    c = srv.client()
    c.put_namespace("kv", PAGE)
    assert c.exists_where("kv", keys) == (4, 0, 4)
    assert c.get_page("kv", "k0") == page("k0")  # promoted into the host pool
    assert c.exists_where("kv", keys) == (4, 1, 4)
    c.put_page("kv", "k4", page("k4"))
    assert c.exists_where("kv", ["k4", "k5"]) == (1, 1, 1)
    assert c.exists_where("kv", keys) == (5, 1, 5)
    assert c.exists("kv", keys) == 5  # without `where`: the prefix only


def test_skipped_restores_are_counted(server):
    c = server.client()
    c.put_namespace("kv", PAGE)
    assert c.skipped("kv", 1, 3) == 1
    assert c.skipped("kv", 2, 5) == 3
    ns = c.stats()["namespaces"]["kv"]
    assert (ns["restores_skipped"], ns["restore_pages_skipped"]) == (3, 8)
    text = c.metrics()
    assert 'kv_sidecar_restores_skipped_total{namespace="kv"} 3.0' in text
    assert 'kv_sidecar_restore_pages_skipped_total{namespace="kv"} 8.0' in text
    for bad in ({"loads": -1}, {"loads": 5000}, {"pages": "1"}, {"loads": True}, {"pages": 1.5}):
        with pytest.raises(SidecarError) as e:
            c.request("POST", "/v1/namespaces/kv/skipped", bad)
        assert e.value.status == 400
    with pytest.raises(SidecarError) as e:
        c.skipped("nope", 1, 1)
    assert e.value.status == 404
    assert c.stats()["namespaces"]["kv"]["restores_skipped"] == 3


A, B = 65534, 65532


def _make_kv(url: str) -> None:
    c = SidecarClient(url)
    c.put_namespace("kv", PAGE)
    c.put_namespace("team", PAGE, share_gid=B)


def _count(url: str) -> dict:
    c = SidecarClient(url)
    c.put_namespace("team", PAGE, share_gid=B)  # B, a member, joins it (A's: A made it first)
    out = {}
    for ns in ("kv", "team"):
        try:
            out[ns] = c.skipped(ns, 1, 1)
        except SidecarError as exc:
            out[ns] = exc.status
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="tenants of other uids need root")
def test_a_tenant_counts_only_on_its_own_namespaces(make_server):
    srv = make_server(socket_mode=0o666)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    as_user(_make_kv, srv.socket_url, uid=A, groups=[B])
    assert as_user(_count, srv.socket_url, uid=B) == {"kv": 404, "team": 403}
    assert as_user(_count, srv.socket_url, uid=A, groups=[B]) == {"kv": 1, "team": 1}
