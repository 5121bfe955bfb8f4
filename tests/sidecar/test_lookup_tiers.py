"""Look-ups across the host pool and durable tiers: `exists` and the batch hit rule give the
same answers whether a page sits in the host pool or only in a tier, for a local tier
(answered on the event loop) and for one looked up off the loop as Mooncake is (a real
file tier flagged `remote_lookup`: the store then awaits it, once per request and pool)."""

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from pools import Arena, HostPool
from sidecar.buffers import Sources
from sidecar.hybrid import ExtraPool, batch_exists
from sidecar.spec import parse_spec
from sidecar.store import Store
from sidecar.tiering import Tiering
from sidecar.tiers.file_tier import FileTier
from tests.sidecar.test_hybrid_rule import reference

PAGE = 512
KEYS = [f"{i:064x}" for i in range(80)]


@pytest.fixture(params=["local", "remote"])
def store(request, tmp_path):
    tier = FileTier("file", str(tmp_path / "tier"))
    if request.param == "remote":
        tier.remote_lookup = True  # looked up in the executor, as a network tier is
    arena, executor = Arena(4 << 20), ThreadPoolExecutor(2)
    host = HostPool(arena, 64 << 10)
    s = Store(
        host, executor, Sources(["/dev/shm"]), tiering=Tiering([tier], "none", None, host, executor)
    )
    yield s, tier
    executor.shutdown()
    arena.close()


def fill(store, tier, name, where):
    """where[i]: 0 absent, 1 in the host pool, 2 only in the tier."""
    store.put_namespace(name, parse_spec({"page_bytes": PAGE}))
    ns = store.namespace(name)
    jobs = [
        (ns.identity, k, memoryview(bytes(PAGE)))
        for k, w in zip(KEYS, where, strict=True)
        if w == 2
    ]
    assert all(tier.write_batch(jobs))
    for k, w in zip(KEYS, where, strict=True):
        if w == 1:
            ns.pool.commit(ns.pool.reserve(k))


def test_prefix_and_batch_rule_see_tier_pages(store):
    store, tier = store
    assert store.tiering.remote == tier.remote_lookup
    rng = random.Random("lookup-tiers")
    for trial in range(30):
        kv = [rng.choice([1, 1, 2]) for _ in KEYS]
        kv[rng.randrange(len(KEYS))] = 0 if trial % 3 else kv[0]
        # every other trial, no page is absent: each pool restores the whole prefix, some
        # of it from the tier (what the shortcut without `restorable` answers)
        held = [0, 1, 1, 2] if trial % 2 else [1, 2]
        pools = [
            (
                [rng.choice(held) for _ in KEYS],
                rng.choice(["all_pages", "trailing_pages"]),
                rng.choice([1, 3, 8]),
            )
            for _ in range(rng.randint(1, 3))
        ]
        try:
            fill(store, tier, "kv", kv)
            for j, (where, _, _) in enumerate(pools):
                fill(store, tier, f"p{j}", where)
            extra = [ExtraPool(f"p{j}", policy, w) for j, (_, policy, w) in enumerate(pools)]
            prefix = asyncio.run(store.lookup.prefix("kv", KEYS))
            got = asyncio.run(batch_exists(store, KEYS, "kv", extra, restorable=True))
            short = asyncio.run(batch_exists(store, KEYS, "kv", extra))
            walked = asyncio.run(batch_exists(store, KEYS, "kv", extra))  # through the joint made
            again = asyncio.run(batch_exists(store, KEYS, "kv", extra, restorable=True))
        finally:
            for name in list(store.namespaces):
                tier.drop(store.delete_namespace(name).identity)
        ref_kv, hit, own, common = reference(
            [w > 0 for w in kv], [([w > 0 for w in p], pol, win) for p, pol, win in pools]
        )
        assert prefix == ref_kv
        assert (got["kv"], got["hit"], list(got["pools"].values()), got["restorable"]) == (
            ref_kv,
            hit,
            own,
            common,
        ), trial
        assert short == walked == {"hit": hit, "kv": ref_kv, "pools": got["pools"]}, trial
        assert again == got, trial
