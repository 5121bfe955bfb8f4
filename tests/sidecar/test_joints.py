"""The store's joints: made by the first batch/exists that names the pools, built a chunk a
step on the event loop (answers stay right meanwhile), bounded, and gone with a namespace."""
import asyncio

import pytest

from pools import Arena, HostPool
from sidecar import joints as joints_mod
from sidecar.buffers import Sources
from sidecar.hybrid import ExtraPool, batch_exists
from sidecar.spec import parse_spec
from sidecar.store import Store

KEYS = [f"{i:064x}" for i in range(30)]
IDX = ExtraPool("idx", "all_pages")


@pytest.fixture
def store():
    arena = Arena(4 << 20)
    yield Store(HostPool(arena, 64 << 10), None, Sources(["/dev/shm"]))
    arena.close()


def fill(store, name, keys=KEYS):
    store.put_namespace(name, parse_spec({"page_bytes": 64}))
    pool = store.namespace(name).pool
    for k in keys:
        pool.commit(pool.reserve(k))


def test_a_large_joint_builds_a_chunk_a_step_and_answers_right_meanwhile(store, monkeypatch):
    monkeypatch.setattr(joints_mod, "BUILD_CHUNK", 4)
    fill(store, "kv")
    fill(store, "idx", KEYS[:20] + KEYS[21:])   # page 20 missing: hit 20

    async def scenario():
        answers = [await batch_exists(store, KEYS, "kv", [IDX])]
        joint = store.joints.by_names[("kv", "idx")]
        assert not joint.built and len(joint.full) == 4 and store.joints._building
        steps = 0
        while not joint.built:
            await asyncio.sleep(0)   # the build yields to the loop between chunks
            answers.append(await batch_exists(store, KEYS, "kv", [IDX]))
            steps += 1
        assert steps >= 29 // 4 and not store.joints._building
        joint.invariants()
        return answers

    answers = asyncio.run(scenario())
    assert all(a == {"hit": 20, "kv": 30, "pools": {"idx": 20}} for a in answers)


def test_joints_stay_bounded(store, monkeypatch):
    monkeypatch.setattr(joints_mod, "MAX_JOINTS", 2)
    for name in ["kv", "a", "b", "c"]:
        fill(store, name, KEYS[:3])
    assert store.joint("kv", []) is None and store.joint("kv", ["kv"]) is None  # no other pool
    assert store.joint("kv", ["missing"]) is None
    assert store.joint("kv", [f"n{i}" for i in range(joints_mod.MAX_POOLS)]) is None
    first = store.joint("kv", ["b", "a"])
    assert first is store.joint("kv", ["a", "b", "a"]) and first.built  # one per set of names
    assert store.joint("kv", ["c"]) is not None
    assert store.joint("a", ["c"]) is None             # full: none evicted, none made
    assert len(store.joints.by_names) == 2 and store.namespace("a").pool.joints == [first]


def test_no_new_joint_while_one_builds(store, monkeypatch):
    monkeypatch.setattr(joints_mod, "BUILD_CHUNK", 4)
    for name in ["kv", "a", "b"]:
        fill(store, name)

    async def scenario():
        building = store.joint("kv", ["a"])
        assert not building.built and store.joint("kv", ["b"]) is None
        while not building.built:
            await asyncio.sleep(0)
        nxt = store.joint("kv", ["b"])
        assert nxt is not None and store.joint("a", ["b"]) is None  # the next one builds
        while not nxt.built:
            await asyncio.sleep(0)
        nxt.invariants()
    asyncio.run(scenario())


def test_deleting_a_namespace_drops_its_joints(store):
    for name in ["kv", "idx", "other"]:
        fill(store, name)
    asyncio.run(batch_exists(store, KEYS, "kv", [IDX]))
    kept = store.joint("other", ["kv"])
    store.delete_namespace("idx")
    assert list(store.joints.by_names) == [("other", "kv")]
    assert store.namespace("kv").pool.joints == [kept]
    fill(store, "idx", KEYS[:5])    # the same name, other pages: a new joint, the new pool's
    got = asyncio.run(batch_exists(store, KEYS, "kv", [IDX]))
    assert got == {"hit": 5, "kv": 30, "pools": {"idx": 5}}
    assert store.joints.by_names[("kv", "idx")].pools[1] is store.namespace("idx").pool
