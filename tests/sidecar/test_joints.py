"""The store's joints: made by the first batch/exists that names the pools, built a chunk a
step on the event loop (answers stay right meanwhile), bounded, and gone with a namespace."""

import asyncio

import pytest

from pools import Arena, HostPool
from sidecar import joints as joints_mod
from sidecar.buffers import Sources
from sidecar.errors import SidecarError
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
    store.put_namespace(name, parse_spec({"page_bytes": 512}))
    pool = store.namespace(name).pool
    for k in keys:
        pool.commit(pool.reserve(k))


def test_a_large_joint_builds_a_chunk_a_step_and_answers_right_meanwhile(store, monkeypatch):
    monkeypatch.setattr(joints_mod, "BUILD_CHUNK", 4)
    fill(store, "kv")
    fill(store, "idx", KEYS[:20] + KEYS[21:])  # page 20 missing: hit 20

    async def scenario():
        answers = [await batch_exists(store, KEYS, "kv", [IDX])]  # checked, then made
        joint = store.joints.by_names[("idx", "kv")]
        assert not joint.built and len(joint.masks) == 4 and store.joints._building
        steps = 0
        while not joint.built:
            await asyncio.sleep(0)  # the build yields to the loop between chunks
            answers.append(await batch_exists(store, KEYS, "kv", [IDX]))
            steps += 1
        assert steps >= 59 // 4 and not store.joints._building  # both pools' keys
        joint.invariants()
        return answers

    answers = asyncio.run(scenario())
    assert all(a == {"hit": 20, "kv": 30, "pools": {"idx": 20}} for a in answers)


def test_joints_stay_bounded(store, monkeypatch):
    monkeypatch.setattr(joints_mod, "MAX_JOINTS", 3)
    monkeypatch.setattr(joints_mod, "PER_POOL", 2)
    for name in ["kv", "a", "b", "c", "d"]:
        fill(store, name, KEYS[:3])
    for others in ([], ["kv"], ["missing"], [f"n{i}" for i in range(joints_mod.MAX_POOLS)]):
        assert store.lookup.make_joint("kv", others) is None  # no other pool, or no such one
    first = store.lookup.make_joint("kv", ["b", "a"])
    assert first.built and first is store.lookup.joint(
        "a", ["b", "kv", "a"]
    )  # one per set of names
    assert store.lookup.make_joint("kv", ["c"]) is not None
    assert store.lookup.make_joint("kv", ["d"]) is None  # kv is in PER_POOL joints already
    assert store.lookup.make_joint("c", ["d"]) is not None
    assert store.lookup.make_joint("b", ["d"]) is None  # MAX_JOINTS: none evicted, none made
    assert len(store.joints.by_names) == 3 and store.namespace("a").pool.joints == [first]


def test_a_request_that_fails_its_checks_makes_no_joint(store):
    for name in ["kv", "idx"]:
        fill(store, name)
    for bad in (["bad key!"], "not a list", [["unhashable"]]):
        with pytest.raises(SidecarError):
            asyncio.run(batch_exists(store, bad, "kv", [IDX]))
    assert store.joints.by_names == {}
    asyncio.run(batch_exists(store, KEYS, "kv", [IDX]))
    assert list(store.joints.by_names) == [("idx", "kv")]


def test_a_cancelled_build_drops_its_joint(store, monkeypatch):
    monkeypatch.setattr(joints_mod, "BUILD_CHUNK", 4)
    for name in ["kv", "idx"]:
        fill(store, name)

    async def scenario():
        joint = store.lookup.make_joint("kv", ["idx"])
        assert not joint.built and store.joints._building
        for task in list(store.joints._building):
            task.cancel()
        await asyncio.sleep(0)
        return joint

    joint = asyncio.run(scenario())
    assert store.joints.by_names == {} and joint.pools == () and not store.joints._building
    assert store.namespace("kv").pool.joints == []  # and the next build may start


def test_no_new_joint_while_one_builds(store, monkeypatch):
    monkeypatch.setattr(joints_mod, "BUILD_CHUNK", 4)
    for name in ["kv", "a", "b"]:
        fill(store, name)

    async def scenario():
        building = store.lookup.make_joint("kv", ["a"])
        assert not building.built and store.lookup.make_joint("kv", ["b"]) is None
        while not building.built:
            await asyncio.sleep(0)
        nxt = store.lookup.make_joint("kv", ["b"])
        assert nxt is not None and store.lookup.make_joint("a", ["b"]) is None  # one at a time
        while not nxt.built:
            await asyncio.sleep(0)
        nxt.invariants()

    asyncio.run(scenario())


def test_deleting_a_namespace_drops_its_joints(store):
    for name in ["kv", "idx", "other"]:
        fill(store, name)
    asyncio.run(batch_exists(store, KEYS, "kv", [IDX]))
    kept = store.lookup.make_joint("other", ["kv"])
    store.delete_namespace("idx")
    assert list(store.joints.by_names) == [("kv", "other")]
    assert store.namespace("kv").pool.joints == [kept]
    fill(store, "idx", KEYS[:5])  # the same name, other pages: a new joint, the new pool's
    for _ in range(2):  # the first makes the joint, the second walks it
        got = asyncio.run(batch_exists(store, KEYS, "kv", [IDX]))
        assert got == {"hit": 5, "kv": 30, "pools": {"idx": 5}}
    assert store.joints.by_names[("idx", "kv")].pools[0] is store.namespace("idx").pool
