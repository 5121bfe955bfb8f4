"""Hybrid models through the API: every pool kind, KV + Mamba + indexer + draft round trips,
KV-first gating, rank isolation, replicated dedupe, one pool out of room."""

import hashlib

import pytest

from api.engine.client import SidecarError
from api.engine.shm import SharedBuffer, tensor_chunks
from sidecar.spec import POOL_KINDS

KV_PAGE = 4096
SLOTS = 8
# Mamba state: a temporal chunk and two conv chunks of unequal sizes
MAMBA = (1536, 320, 192)
INDEXER = 528
DRAFT = 2048


def data(key: str, pool: str, size: int) -> bytes:
    return hashlib.shake_256(f"{pool}/{key}".encode()).digest(size)


class Engine:
    """An engine's host pools in one memfd: KV (K/V split), Mamba (3 chunks), indexer, draft."""

    def __init__(self, client, names, tp=0):
        self.client, self.names = client, names
        sizes = [KV_PAGE // 2, KV_PAGE // 2, *MAMBA, INDEXER, DRAFT]
        self.buf = SharedBuffer(SLOTS * sum(sizes))
        self.t, off = [], 0
        for s in sizes:
            self.t.append(self.buf.tensor((SLOTS, s), offset=off))
            off += SLOTS * s
        groups = {
            "kv": self.t[0:2],
            "mamba": self.t[2:5],
            "indexer": self.t[5:6],
            "draft": self.t[6:7],
        }
        self.groups = groups
        self.ids = {
            pool: self.buf.register(client, names[pool], SLOTS, tensor_chunks(self.buf, ts))
            for pool, ts in groups.items()
        }

    def fill(self, keys):
        for slot, k in enumerate(keys):
            for pool, ts in self.groups.items():
                page = data(k, pool, sum(t[0].numel() for t in ts))
                off = 0
                for t in ts:
                    n = t[0].numel()
                    self.buf.view(t[slot].data_ptr() - self.buf.address, n)[:] = page[off : off + n]
                    off += n

    def page(self, pool, slot):
        return b"".join(self.buf.tensor_bytes(t[slot]) for t in self.groups[pool])

    def items(self, keys, pools=("kv", "mamba", "indexer", "draft")):
        return [
            {
                "namespace": self.names[p],
                "keys": keys,
                "buffer_id": self.ids[p],
                "slots": list(range(len(keys))),
            }
            for p in pools
        ]


def create(client, tp=0, tp_size=1, mamba_capacity=None):
    rank = {"tp": tp, "tp_size": tp_size}
    names = {"kv": "m-kv", "mamba": f"m-mamba-tp{tp}", "indexer": "m-indexer", "draft": "m-draft"}
    client.put_namespace("m-kv", KV_PAGE, pool="kv", model="m", rank=rank, replicated=True)
    client.put_namespace(
        names["mamba"],
        sum(MAMBA),
        pool="mamba",
        model="m",
        rank=rank,
        **({"host_capacity_bytes": mamba_capacity * sum(MAMBA)} if mamba_capacity else {}),
    )
    client.put_namespace(
        "m-indexer", INDEXER, pool="indexer", model="m", rank=rank, replicated=True
    )
    client.put_namespace("m-draft", DRAFT, pool="draft", model="m", rank=rank, replicated=True)
    return names


def test_every_pool_kind_is_a_namespace(client):
    for i, kind in enumerate(POOL_KINDS):
        spec = client.put_namespace(
            f"ns-{kind}",
            512,
            pool=kind,
            replicated=i % 2 == 0,
            rank={"tp": 1, "tp_size": 2, "pp": 0, "pp_size": 1},
        )["spec"]
        assert spec["pool"] == kind and spec["replicated"] == (i % 2 == 0)
        assert spec["rank"]["tp"] == (0 if i % 2 == 0 else 1)  # replicated: one copy for all ranks
    assert len(client.list_namespaces()) == len(POOL_KINDS) >= 13


def test_round_trip_kv_mamba_indexer_draft(client, server):
    names = create(client)
    writer, reader = Engine(client, names), Engine(client, names)
    keys = [f"{i:064x}" for i in range(6)]
    writer.fill(keys)
    stored = client.batch_set(writer.items(keys))
    assert stored == {names[p]: [True] * 6 for p in ("kv", "mamba", "indexer", "draft")}
    extra = [
        {"namespace": names["mamba"], "policy": "trailing_pages", "window": 1},
        {"namespace": "m-indexer", "policy": "all_pages"},
        {"namespace": "m-draft", "policy": "all_pages"},
    ]
    assert client.batch_exists(keys + ["f" * 64], "m-kv", extra) == {
        "hit": 6,
        "kv": 6,
        "pools": {names["mamba"]: 6, "m-indexer": 6, "m-draft": 6},
    }
    loaded = client.batch_get(reader.items(keys))
    assert all(all(v) for v in loaded.values())
    for slot, _k in enumerate(keys):
        for pool in ("kv", "mamba", "indexer", "draft"):
            assert reader.page(pool, slot) == writer.page(pool, slot)
    server.invariants()


def test_hit_rules_on_partial_pools(client):
    names = create(client)
    e = Engine(client, names)
    keys = [f"{i:064x}" for i in range(6)]
    e.fill(keys)
    client.batch_set(e.items(keys[:5], ("kv",)))
    client.batch_set(e.items([keys[2], keys[4]], ("mamba",)))  # Mamba state at pages 3 and 5
    client.batch_set(e.items(keys[:2] + keys[3:5], ("indexer",)))
    mamba = {"namespace": names["mamba"], "policy": "trailing_pages", "window": 1}
    assert client.batch_exists(keys, "m-kv", [mamba]) == {
        "hit": 5,
        "kv": 5,
        "pools": {names["mamba"]: 5},
    }
    idx = {"namespace": "m-indexer", "policy": "all_pages"}
    # Mamba restores endpoints {3, 5}, the indexer {1, 2}: none in common (min would say 2)
    got = client.batch_exists(keys, "m-kv", [mamba, idx], restorable=True)
    assert got == {
        "hit": 0,
        "kv": 5,
        "pools": {names["mamba"]: 5, "m-indexer": 2},
        "restorable": [],
    }
    client.batch_set(e.items([keys[2]], ("indexer",)))  # the indexer now restores 1..5
    got = client.batch_exists(keys, "m-kv", [mamba, idx], restorable=True)
    assert (got["hit"], got["restorable"]) == (5, [3, 5])
    missing = {"namespace": "nope", "policy": "all_pages"}
    got = client.batch_exists(keys, "m-kv", [missing, mamba])
    assert got["hit"] == 0 and got["pools"] == {"nope": 0, names["mamba"]: 5}
    for _ in range(2):  # a window of 2**64 - 1 pages is the whole prefix (the joint's masks too)
        huge = {"namespace": names["mamba"], "policy": "trailing_pages", "window": 2**64 - 1}
        assert client.batch_exists(keys, "m-kv", [huge]) == {
            "hit": 0,
            "kv": 5,
            "pools": {names["mamba"]: 0},
        }


def test_batch_get_of_the_hit_loads_exactly_its_pages(client, server):
    names = create(client)
    w, r = Engine(client, names), Engine(client, names)
    keys = [f"{i:064x}" for i in range(6)]
    w.fill(keys)
    client.batch_set(w.items(keys[:5], ("kv",)) + w.items(keys[:4], ("indexer",)))
    mamba = {
        "namespace": names["mamba"],
        "keys": keys[2:3],
        "buffer_id": w.ids["mamba"],
        "slots": [2],
    }
    client.batch_set([mamba])  # Mamba state for endpoint 3 only
    extra = [
        {"namespace": names["mamba"], "policy": "trailing_pages", "window": 1},
        {"namespace": "m-indexer", "policy": "all_pages"},
    ]
    got = client.batch_exists(keys, "m-kv", extra, restorable=True)
    assert (got["hit"], got["restorable"]) == (3, [3])
    before = {ns: v["hits"] for ns, v in client.stats()["namespaces"].items()}
    items = r.items(keys[:3], ("kv", "indexer")) + [{**mamba, "buffer_id": r.ids["mamba"]}]
    loaded = client.batch_get(items)
    assert loaded == {"m-kv": [True] * 3, "m-indexer": [True] * 3, names["mamba"]: [True]}
    after = client.stats()["namespaces"]
    assert {ns: after[ns]["hits"] - before[ns] for ns in loaded} == {
        "m-kv": 3,
        "m-indexer": 3,
        names["mamba"]: 1,
    }
    for pool in ("kv", "indexer", "mamba"):
        assert r.page(pool, 2) == w.page(pool, 2)
    server.invariants()


def test_batch_get_serves_extra_pools_only_after_every_kv_page(client, server):
    names = create(client)
    w, r = Engine(client, names), Engine(client, names)
    keys = [f"{i:064x}" for i in range(4)]
    w.fill(keys)
    client.batch_set(w.items(keys))
    client.delete("m-kv", [keys[3]])
    loaded = client.batch_get(r.items(keys))
    assert loaded["m-kv"] == [True, True, True, False]
    assert loaded[names["mamba"]] == [False] * 4 and loaded["m-indexer"] == [False] * 4
    # naming the anchor explicitly works the same
    loaded = client.batch_get(r.items(keys[:3]), kv="m-kv")
    assert all(all(v) for v in loaded.values())
    server.invariants()


def test_rank_isolation_and_replicated_dedupe(client, server):
    n0, n1 = create(client, tp=0, tp_size=2), create(client, tp=1, tp_size=2)
    assert n0["mamba"] != n1["mamba"] and n0["kv"] == n1["kv"]
    e0, e1 = Engine(client, n0), Engine(client, n1)
    keys = [f"{i:064x}" for i in range(3)]
    e0.fill(keys)
    client.batch_set(e0.items(keys))
    stored_before = client.stats()["namespaces"]["m-kv"]["stored"]
    # rank 1 writes the same replicated pages: present, no second copy
    assert client.batch_set(e1.items(keys, ("kv",))) == {"m-kv": [True] * 3}
    assert client.stats()["namespaces"]["m-kv"]["stored"] == stored_before
    # but rank 1 never reads rank 0's Mamba shard
    assert client.exists(n1["mamba"], keys) == 0 and client.exists(n0["mamba"], keys) == 3
    with pytest.raises(SidecarError) as exc:  # a rank-1 spec under rank 0's name
        client.put_namespace(
            n0["mamba"], sum(MAMBA), pool="mamba", model="m", rank={"tp": 1, "tp_size": 2}
        )
    assert exc.value.status == 409
    server.invariants()


def test_one_pool_out_of_room_does_not_fail_the_others(client, server):
    names = create(client, mamba_capacity=2)
    e = Engine(client, names)
    keys = [f"{i:064x}" for i in range(4)]
    e.fill(keys)
    stored = client.batch_set(e.items(keys))
    assert stored["m-kv"] == [True] * 4 and stored["m-indexer"] == [True] * 4
    assert stored[names["mamba"]] == [True, True, False, False]
    server.invariants()


def test_batch_errors_move_nothing(client, server):
    names = create(client)
    e = Engine(client, names)
    keys = ["a", "b"]
    e.fill(keys)
    bad = e.items(keys, ("kv",)) + [
        {
            "namespace": names["mamba"],
            "keys": keys,
            "buffer_id": e.ids["mamba"],
            "slots": [0, SLOTS],
        }
    ]
    with pytest.raises(SidecarError) as exc:
        client.batch_set(bad)
    assert exc.value.status == 422 and client.exists("m-kv", keys) == 0  # nothing stored
    for body, status in [
        ({"items": e.items(keys, ("kv", "kv"))}, 400),
        ({"items": []}, 400),
        ({"items": [{"namespace": "nope", "keys": keys, "buffer_id": "b", "slots": [0, 1]}]}, 404),
    ]:
        with pytest.raises(SidecarError) as exc:
            client.request("POST", "/v1/batch/set", body)
        assert exc.value.status == status
    for extra in (
        [{"namespace": "x", "policy": "some"}],
        [{"namespace": "x", "window": 0}],
        [{"policy": "all_pages"}],
        "x",
    ):
        with pytest.raises(SidecarError) as exc:
            client.batch_exists(keys, "m-kv", extra)
        assert exc.value.status == 400
    with pytest.raises(SidecarError) as exc:
        client.request("POST", "/v1/batch/exists", {"keys": keys, "kv": "m-kv", "restorable": 1})
    assert exc.value.status == 400
    with pytest.raises(SidecarError) as exc:
        client.batch_exists(keys, "no-such-kv")
    assert exc.value.status == 404
    with pytest.raises(SidecarError) as exc:
        client.batch_get(e.items(keys, ("mamba",)), kv="m-kv")
    assert exc.value.status == 400


@pytest.mark.parametrize("op", ["set", "get"])
def test_every_batch_item_is_validated_before_any_page_moves(client, server, monkeypatch, op):
    """A bad item anywhere in a batch (here the last) fails the request before the store is
    asked to move a single page: a spy on the store's set/get sees no call at all (no race
    with a background copy of the good items)."""
    names = create(client)
    e = Engine(client, names)
    keys = ["a", "b"]
    e.fill(keys)
    if op == "get":
        assert all(all(v) for v in client.batch_set(e.items(keys)).values())
    store = server.ctx.store
    calls = []
    real = getattr(store, op)

    def spy(name, *args, **kw):
        calls.append(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(store, op, spy)
    for bad in ({"slots": [0, SLOTS]}, {"keys": ["a", "b/"]}, {"buffer_id": "b-none"}):
        items = e.items(keys, ("kv", "indexer", "mamba"))
        items[-1] = {**items[-1], **bad}
        with pytest.raises(SidecarError) as exc:
            getattr(client, f"batch_{op}")(items)
        assert 400 <= exc.value.status < 500
        assert calls == [], f"{bad}: the store moved pages for {calls} before validating every item"
    if op == "set":
        assert client.exists("m-kv", keys) == 0
