"""The Mooncake tier against a real mooncake_master and store node on loopback."""

import hashlib

import pytest

from loadtest.kit.mooncake_cluster import Master, StoreNode
from pools import Arena
from sidecar.tiers import pagefile
from sidecar.tiers.mooncake_tier import MooncakeSettings, MooncakeTier
from tests.conftest import wait_for

PAGE = 256 * 1024
ID = "a" * 32


def data(key: str, size: int = PAGE) -> bytes:
    return hashlib.shake_256(key.encode()).digest(size)


@pytest.fixture
def arena():
    a = Arena(16 * PAGE)
    yield a
    a.close()


def make_tier(master, arena, connect=True) -> MooncakeTier:
    tier = MooncakeTier(MooncakeSettings(master.address, segment_size=0))
    tier.attach(arena.address, arena.size)
    tier.recover()
    if connect:
        wait_for(lambda: tier.connected)
    return tier


def fill(arena, slot: int, key: str) -> memoryview:
    view = arena.view(slot * PAGE, PAGE)
    view[:] = data(key)
    return view


def raw_client(master):
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * 2**20, "tcp", "", master.address) == 0
    return client


def test_pages_round_trip_byte_exact_and_lookup_is_one_batch(cluster, arena):
    tier = make_tier(cluster[0], arena)
    jobs = [(ID, f"k{i}", fill(arena, i, f"k{i}")) for i in range(4)]
    jobs.append((ID, "staged", data("staged")))  # a write-back copy: read-only bytes
    assert tier.write_batch(jobs) == [True] * 5
    calls = []
    tier._client = _Spy(tier._client, calls)
    assert tier.lookup(ID, ["k0", "k3", "staged", "nope"]) == [True, True, True, False]
    assert calls == [4]  # one call for all keys
    tier._client = tier._client.inner
    assert tier.lookup("b" * 32, ["k0"]) == [False]  # another identity: other pages
    dst = [arena.view((8 + i) * PAGE, PAGE) for i in range(3)]
    for d in dst:
        d[:] = bytes(PAGE)
    got = tier.read_batch(ID, [("k2", dst[0]), ("nope", dst[1]), ("staged", dst[2])])
    assert got == [True, False, True]
    assert dst[0] == data("k2") and dst[2] == data("staged")
    assert tier.stats.evicted == 1 and tier.stats.pages_read == 2
    tier.close()


class _Spy:
    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    def batch_is_exist(self, keys):
        self.calls.append(len(keys))
        return self.inner.batch_is_exist(keys)


def test_wrong_bytes_under_a_key_are_a_miss_and_removed(cluster, arena):
    tier = make_tier(cluster[0], arena)
    raw = raw_client(cluster[0])
    mkey = f"kvs/{ID}/bad"
    good_head = pagefile.encode_header(mkey, data("bad"))
    forged = bytearray(good_head + data("bad"))
    forged[-1] ^= 1  # one flipped bit in the page
    assert raw.put(mkey, bytes(forged)) == 0
    assert raw.put(f"kvs/{ID}/short", b"x" * 100) == 0  # not a page of this size at all
    assert tier.lookup(ID, ["bad", "short"]) == [True, True]
    dst = arena.view(0, PAGE)
    assert tier.read_batch(ID, [("bad", dst), ("short", arena.view(PAGE, PAGE))]) == [False, False]
    assert tier.stats.corrupt == 1  # a short object fails the transfer
    assert tier.stats.read_errors + tier.stats.corrupt == 2
    assert tier.lookup(ID, ["bad"]) == [False]  # the forged page was removed
    raw.close()
    tier.close()


def test_evicted_between_exists_and_get_is_a_miss(cluster, arena):
    tier = make_tier(cluster[0], arena)
    assert tier.write_batch([(ID, "k", fill(arena, 0, "k"))]) == [True]
    assert tier.lookup(ID, ["k"]) == [True]
    raw = raw_client(cluster[0])
    assert raw.batch_remove([f"kvs/{ID}/k"], True) == [0]  # another node removed it meanwhile
    assert tier.read_batch(ID, [("k", arena.view(PAGE, PAGE))]) == [False]
    assert tier.stats.evicted == 1 and not tier.contains(ID, "k")
    raw.close()
    tier.close()


def test_master_down_at_start_then_restarted_mid_run(arena):
    master = Master()  # not started yet
    tier = make_tier(master, arena, connect=False)
    view = fill(arena, 0, "k")
    assert tier.write_batch([(ID, "k", view)]) == [False]
    assert tier.lookup(ID, ["k"]) == [False]
    assert tier.read_batch(ID, [("k", arena.view(PAGE, PAGE))]) == [False]
    assert tier.stats.unavailable == 3 and tier.describe()["degraded"]
    master.start()
    node = StoreNode(master, "64MB").start()
    try:
        wait_for(lambda: tier.connected)
        wait_for(lambda: tier.write_batch([(ID, "k", view)]) == [True])
        master.restart()  # its objects are gone with it
        before = tier.stats.unavailable
        assert tier.lookup(ID, ["k"]) == [False]  # down, then empty: a miss either way
        wait_for(lambda: tier.write_batch([(ID, "k2", view)]) == [True])  # clients remount
        assert tier.stats.unavailable + tier.stats.write_errors + tier.stats.no_space >= before
        dst = arena.view(PAGE, PAGE)
        assert tier.read_batch(ID, [("k2", dst)]) == [True] and dst == data("k")
    finally:
        tier.close()
        node.kill()
        master.kill()


def test_a_full_cluster_refuses_or_evicts_never_corrupts(arena):
    master = Master().start()
    node = StoreNode(master, "16MB").start()  # room for ~60 of these 96 pages
    tier = make_tier(master, arena)
    try:
        keys = [f"f{i}" for i in range(96)]
        written = []
        for r in range(0, len(keys), 16):
            jobs = [(ID, k, fill(arena, i, k)) for i, k in enumerate(keys[r : r + 16])]
            written += tier.write_batch(jobs)
        readable = 0
        for k in keys:
            dst = arena.view(0, PAGE)
            dst[:] = bytes(PAGE)
            if tier.read_batch(ID, [(k, dst)]) == [True]:
                assert dst == data(k)
                readable += 1
        assert 0 < readable < len(keys)  # refused or evicted, never wrong
        assert tier.stats.no_space + tier.stats.evicted >= len(keys) - readable
    finally:
        tier.close()
        node.kill()
        master.kill()
