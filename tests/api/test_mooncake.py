"""Sidecars sharing pages through a real Mooncake cluster (mooncake_master + a store node on
loopback): two sidecars with their own host pools, a restart with an empty host pool, the
master down at start and restarted mid-run."""

import hashlib

import pytest

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.mooncake_cluster import Master, StoreNode
from tests.conftest import wait_for

PAGE = 64 * 1024
N = 16


def data(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def sidecar(spawn, master, *extra):
    """A sidecar with the Mooncake tier only (no file tier), lending no memory itself."""
    p = spawn(
        "--host-pool",
        "16MiB",
        "--no-file-tier",
        "--mooncake-master",
        master.address,
        "--mooncake-segment-size",
        "0",
        *extra,
    ).wait_ready()
    c = SidecarClient(p.socket_url, timeout=30)
    c.put_namespace("kv", PAGE, model="m")
    return p, c


def mooncake_connected(c) -> bool:
    return c.stats()["tiers"]["mooncake"]["connected"]


def buffer(c, keys, fill=True):
    buf = SharedBuffer(len(keys) * PAGE)
    for i, k in enumerate(keys):
        buf.view(i * PAGE, PAGE)[:] = data(k) if fill else bytes(PAGE)
    return buf, buf.register(c, "kv", len(keys), page_first_chunks(PAGE))


def durable_set(c, keys, bid) -> list[bool]:
    body = {"keys": keys, "buffer_id": bid, "slots": list(range(len(keys))), "durable": True}
    return c.request("POST", "/v1/namespaces/kv/set", body)[1]["stored"]


def read_all(c, keys) -> tuple[list[bool], SharedBuffer]:
    out, oid = buffer(c, keys, fill=False)
    return c.get("kv", keys, oid, list(range(len(keys)))), out


@pytest.mark.slow
def test_two_sidecars_share_pages_and_a_restart_finds_them(spawn, cluster):
    master, _ = cluster
    a, ca = sidecar(spawn, master)
    b, cb = sidecar(spawn, master)
    wait_for(lambda: mooncake_connected(ca) and mooncake_connected(cb))
    keys = [f"k{i}" for i in range(N)]
    _, bid = buffer(ca, keys)
    assert durable_set(ca, keys, bid) == [True] * N
    assert cb.exists("kv", keys + ["nope"]) == N  # one batched look-up on B
    loaded, out = read_all(cb, keys)
    assert loaded == [True] * N
    assert all(out.view(i * PAGE, PAGE) == data(k) for i, k in enumerate(keys))
    assert cb.stats()["namespaces"]["kv"]["tier_hits"] == N
    cb.put_namespace("other", PAGE, model="m2")  # another spec: other pages
    assert cb.exists("other", keys) == 0
    assert a.terminate()[0] == 0

    a2, ca2 = sidecar(spawn, master)  # empty host pool
    wait_for(lambda: mooncake_connected(ca2))
    assert ca2.stats()["namespaces"]["kv"]["pages"]["host"] == 0
    assert ca2.exists("kv", keys) == N
    assert ca2.get_page("kv", "k5") == data("k5")
    loaded, out = read_all(ca2, keys)
    assert loaded == [True] * N
    assert all(out.view(i * PAGE, PAGE) == data(k) for i, k in enumerate(keys))
    events = ca2.metrics()
    assert 'kv_sidecar_tier_events_total{event="pages_read",tier="mooncake"}' in events


def until_durable(c, tag: str) -> list[str]:
    """Durable sets of fresh keys (a page already in the host pool is not written again)
    until one lands in Mooncake; return its keys."""
    attempt = []

    def once() -> bool:
        keys = [f"{tag}{len(attempt)}-{i}" for i in range(4)]
        attempt.append(keys)
        _, bid = buffer(c, keys)
        return durable_set(c, keys, bid) == [True] * 4

    wait_for(once)
    return attempt[-1]


@pytest.mark.slow
def test_master_down_at_start_then_killed_and_restarted_mid_run(spawn):
    master = Master()  # not running yet
    a, ca = sidecar(spawn, master)  # starts and serves regardless
    keys = [f"k{i}" for i in range(N)]
    _, bid = buffer(ca, keys)
    assert durable_set(ca, keys, bid) == [False] * N  # kept in the host pool only
    assert ca.get_page("kv", "k1") == data("k1")
    assert ca.stats()["tiers"]["mooncake"]["unavailable"] >= N
    master.start()
    node = StoreNode(master, "64MB").start()
    try:
        b, cb = sidecar(spawn, master)
        wait_for(lambda: mooncake_connected(ca) and mooncake_connected(cb))
        first = until_durable(ca, "a")
        assert cb.exists("kv", first) == 4

        master.kill()  # mid-run: misses, never a 5xx
        assert cb.exists("kv", first) == 0
        loaded, _ = read_all(cb, first)
        assert loaded == [False] * 4
        stats = cb.stats()["tiers"]["mooncake"]
        assert stats["unavailable"] >= 1 and stats["degraded"]
        assert 'event="unavailable",tier="mooncake"' in cb.metrics()

        master.start()  # same port, no objects
        second = until_durable(ca, "b")  # the clients remount
        loaded, out = read_all(cb, first + second)
        assert loaded == [False] * 4 + [True] * 4  # the restart lost the first
        assert all(out.view((4 + i) * PAGE, PAGE) == data(k) for i, k in enumerate(second))
        assert not cb.stats()["tiers"]["mooncake"]["degraded"]
    finally:
        node.kill()
        master.kill()
