"""The SGLang HiCache backend on SGLang 0.5.23's real host pools, loaded by SGLang's own
`StorageBackendFactory` ("dynamic"), against a live sidecar."""

import hashlib
import time

import pytest
import torch

from api.engine.sglang_pools import namespace_name, namespace_spec
from loadtest.kit.sglang import pools as kit
from loadtest.kit.sglang.pools import indices

FP8 = torch.float8_e4m3fn


def make(server, host, **kw):
    """One engine's backend over `host`, as SGLang's factory builds it."""
    kw.setdefault("module_path", "api.engine.sglang_backend")
    backend = kit.dynamic_backend(kit.storage_config(server.socket_url, **kw))
    backend.register_mem_pool_host(host)
    return backend


def keys(n, salt="x"):
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


# (pool builder, layout, dtype, the extra config's "allocator"): with "shm" SGLang puts the
# host pool in a memfd (a registered buffer: zero copy); without it, in private memory (the
# inline page endpoints).
CASES = [
    (kit.mha, layout, torch.bfloat16, alloc) for layout in kit.MHA_LAYOUTS for alloc in ("shm", "")
]
CASES += [(kit.mha, layout, dt, "") for layout in kit.MHA_LAYOUTS for dt in (torch.float16, FP8)]
CASES += [
    (kit.mla, layout, torch.bfloat16, alloc)
    for layout in ("page_first", "layer_first")
    for alloc in ("shm", "")
]
CASES += [(kit.mla, "page_first", FP8, "")]


@pytest.mark.parametrize(
    "build,layout,dtype,allocator",
    CASES,
    ids=[f"{b.__name__}-{lay}-{str(dt)[6:]}-{al or 'default'}" for b, lay, dt, al in CASES],
)
def test_v1_round_trip_on_real_pools(server, build, layout, dtype, allocator):
    (_, a_pool), (_, b_pool) = build(layout, dtype, allocator), build(layout, dtype, allocator)
    mla = build is kit.mla
    a, b = (
        make(server, a_pool, mla=mla, allocator=allocator),
        make(server, b_pool, mla=mla, allocator=allocator),
    )
    zero_copy = allocator == "shm"
    assert (a.bindings["kv"].buffer_id is not None) == zero_copy  # shm memfd: registered buffer
    kit.randomize(a_pool, seed=1)
    kit.randomize(b_pool, seed=2)
    ks, src, dst = keys(6, layout + allocator + str(dtype)), range(1, 7), [9, 3, 12, 4, 8, 15]
    assert a.batch_set_v1(ks, indices(src)) == [True] * 6
    assert b.batch_exists(ks + ["0" * 64]) == 6
    assert b.batch_get_v1(ks, indices(dst)) == [True] * 6
    for s, d in zip(src, dst, strict=True):
        assert kit.page_bytes(b_pool, d) == kit.page_bytes(a_pool, s)
    assert kit.page_bytes(b_pool, 5) != kit.page_bytes(a_pool, 5)  # untouched slots stay
    assert b.batch_get_v1(["f" * 64], indices([2])) == [False]
    assert a.batch_set_v1(ks[:2], indices([1])) == [False, False]  # wrong index count
    assert a.failures == b.failures == 0
    server.invariants()


def test_fp8_pools_store_bytes(server):
    """SGLang keeps fp8 KV as uint8 on the host: the namespace says so, pages are bytes."""
    _, pool = kit.mha("page_first", FP8, "")
    assert pool.dtype == torch.uint8
    be = make(server, pool, allocator="")
    assert server.client().get_namespace(be.bindings["kv"].namespace)["spec"]["dtype"] == "uint8"


def test_v2_rules_on_kv_and_mamba(server):
    (_, kv_pool), (_, state) = kit.mha(), kit.mamba()
    be = make(server, kv_pool)
    be.register_mem_host_pool_v2(kv_pool, kit.PoolName.KV)
    be.register_mem_host_pool_v2(state, kit.PoolName.MAMBA)
    assert be.bindings["mamba"].buffer_id is None  # separate allocations: inline pages
    ks = keys(5, "hyb")
    kit.randomize(kv_pool)
    kit.randomize(state)
    assert be.batch_set_v1(ks, indices(range(5))) == [True] * 5
    t = kit.PoolTransfer(
        name=kit.PoolName.MAMBA, host_indices=torch.tensor([3, 7]), keys=[ks[2], ks[4]]
    )
    assert be.batch_set_v2([t]) == {"mamba": [True, True]}
    probe = kit.mamba_trailing()
    res = be.batch_exists_v2(ks, [probe])
    assert (res.kv_hit_pages, res.extra_pool_hit_pages) == (5, {"kv": 5, "mamba": 5})
    res = be.batch_exists_v2(ks[:4], [probe])  # Mamba state exists at page 3, not 4
    assert (res.kv_hit_pages, res.extra_pool_hit_pages) == (3, {"kv": 4, "mamba": 3})
    swa = kit.PoolTransfer(
        name=kit.PoolName.SWA,
        keys=["__placeholder__"] * 2,
        hit_policy=kit.PoolHitPolicy.TRAILING_PAGES,
    )
    assert be.batch_exists_v2(ks, [swa]).kv_hit_pages == 0  # never registered: 0
    _, fresh = kit.mamba()
    be2 = make(server, kit.mha()[1])
    be2.register_mem_host_pool_v2(fresh, kit.PoolName.MAMBA)
    got = be2.batch_get_v2(
        [
            kit.PoolTransfer(
                name=kit.PoolName.MAMBA, host_indices=torch.tensor([9, 11]), keys=[ks[2], ks[4]]
            )
        ]
    )
    assert got == {"mamba": [True, True]}
    assert kit.page_bytes(fresh, 9) == kit.page_bytes(state, 3)
    assert kit.page_bytes(fresh, 11) == kit.page_bytes(state, 7)
    server.invariants()


def test_generic_path_and_draft_keys(server):
    _, pool = kit.mha()
    be = make(server, pool, interface_v1=0)
    page = pool.get_dummy_flat_data_page()
    pages = [torch.randint(-9, 9, page.shape).to(page.dtype) for _ in range(3)]
    ks = keys(2, "gen") + [keys(1, "d")[0] + ".draft"]
    assert be.batch_set(ks, pages) is True
    assert be.exists(ks[0]) and be.exists(ks[2]) and not be.exists("0" * 64)
    targets = [pool.get_dummy_flat_data_page() for _ in range(3)]
    got = be.batch_get(ks, targets)
    assert all(g is t for g, t in zip(got, targets, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(pages, targets, strict=True))
    assert be.get("1" * 64, pool.get_dummy_flat_data_page()) is None
    # the draft key landed in a namespace of pool kind "draft", the others in a KV one
    c = server.client()
    kinds = {ns["name"]: c.get_namespace(ns["name"])["spec"]["pool"] for ns in c.list_namespaces()}
    holding = {k: [n for n in kinds if c.exists(n, [k]) == 1] for k in ks}
    assert [kinds[n] for n in holding[ks[2]]] == ["draft"], (holding, kinds)
    assert [kinds[n] for n in holding[ks[0]]] == ["kv"] and [kinds[n] for n in holding[ks[1]]] == [
        "kv"
    ]


def test_never_raises_and_recovers_after_a_sidecar_restart(spawn):
    proc = spawn("--host-pool", "32MiB", "--no-file-tier").wait_ready()
    _, pool = kit.mha()
    be = kit.dynamic_backend(
        kit.storage_config(
            proc.socket_url, module_path="api.engine.sglang_backend", sidecar_timeout=2
        )
    )
    be.register_mem_pool_host(pool)
    ks = keys(3, "r")
    kit.randomize(pool)
    assert be.batch_set_v1(ks, indices(range(3))) == [True] * 3
    proc.kill()
    assert be.batch_exists(ks) == 0
    assert be.batch_set_v1(ks, indices(range(3))) == [False] * 3
    assert be.batch_get_v1(ks, indices(range(3))) == [False] * 3
    assert be.batch_exists_v2(ks, []).kv_hit_pages == 0
    assert be.batch_get_v2([kit.PoolTransfer(name=kit.PoolName.MAMBA, keys=ks)]) == {
        "mamba": [False] * 3
    }
    assert (
        be.get(ks[0], torch.zeros(8, dtype=torch.uint8)) is None
        and be.set("k", torch.zeros(8)) is False
    )
    assert be.failures > 0
    again = spawn(
        "--host-pool", "32MiB", "--no-file-tier", port=proc.port, socket=proc.socket
    )  # same address
    try:
        again.wait_ready()
        deadline = time.time() + 10
        while be.batch_set_v1(ks, indices(range(3))) != [True] * 3:  # re-registers by itself
            assert time.time() < deadline
            time.sleep(0.2)
        assert be.batch_exists(ks) == 3
    finally:
        again.kill()


def test_namespaces_are_deterministic_and_scoped():
    def cfg(url="u", **kw):
        return kit.storage_config(url, **kw)

    def name(c, pool, page, layout, dtype=""):
        return namespace_name(c, pool, namespace_spec(c, pool, page, layout, dtype, 64))

    base = cfg("http://127.0.0.1:1")
    assert name(base, "kv", 4096, "page_first", "bfloat16") == name(
        cfg("http://x:2"), "kv", 4096, "page_first", "bfloat16"
    )
    names = {
        name(c, "kv", pb, lay, dt)
        for c, pb, lay, dt in [
            (base, 4096, "page_first", "bfloat16"),
            (cfg(tp=1, tp_size=2), 4096, "page_first", "bfloat16"),
            (cfg(model="other"), 4096, "page_first", "bfloat16"),
            (base, 8192, "page_first", "bfloat16"),
            (base, 4096, "layer_first", "bfloat16"),
            (base, 4096, "page_first", "float8"),
            (cfg(sidecar_scope="lora-a"), 4096, "page_first", "bfloat16"),
        ]
    }
    assert len(names) == 7  # any difference keeps engines apart
    mla0, mla1 = cfg(tp=0, tp_size=2, mla=True), cfg(tp=1, tp_size=2, mla=True)
    kv = [name(c, "kv", 64, "page_first") for c in (mla0, mla1)]
    state = [name(c, "mamba", 64, "page_first") for c in (mla0, mla1)]
    assert kv[0] == kv[1] and state[0] != state[1]  # replicated KV shared, Mamba per rank


def test_parity_with_sglang_hicache_file(server, tmp_path):
    """The same set / exists / get sequence on SGLang's HiCacheFile and on the sidecar."""
    cfg = kit.storage_config(server.socket_url)
    ref = kit.HiCacheFile(cfg, file_path=str(tmp_path / "hicache"))
    _, pool = kit.mha()
    ours = make(server, pool, interface_v1=0)  # HiCacheFile's path
    ks = keys(6, "parity")
    page = ours.bindings["kv"].page_bytes
    vals = {k: torch.randint(0, 256, (page,), dtype=torch.uint8) for k in ks}
    ops = [
        ("exists", ks[0]),
        ("set", ks[0]),
        ("exists", ks[0]),
        ("set", ks[0]),
        ("get", ks[0]),
        ("get", ks[1]),
        ("batch_set", ks[1:4]),
        ("batch_exists", ks),
        ("batch_exists", ks[:3]),
        ("get", ks[2]),
        ("exists", ks[5]),
        ("batch_get", ks[:5]),
    ]
    for op, arg in ops:
        answers = []
        for be in (ref, ours):
            if op in ("exists", "batch_exists"):
                answers.append(getattr(be, op)(arg))
            elif op == "set":
                answers.append(be.set(arg, vals[arg]))
            elif op == "batch_set":
                answers.append(be.batch_set(arg, [vals[k] for k in arg]))
            elif op == "get":
                out = be.get(arg, torch.zeros(page, dtype=torch.uint8))
                answers.append(None if out is None else bytes(out.tolist()))
            else:
                outs = be.batch_get(arg, [torch.zeros(page, dtype=torch.uint8) for _ in arg])
                answers.append([None if o is None else bytes(o.tolist()) for o in outs])
        assert answers[0] == answers[1], (op, answers)


def test_v2_endpoint_every_pool_restores_and_loads_exactly_its_pages(server):
    """Issue 12's last row: SWA restores {1, 3}, Mamba {1, 2} (windows of 1 page over 3 KV
    pages). The answer is 1 (min of the bests said 2, where SWA has no state), the result
    names only endpoints both can serve, and the get for it loads one page from each."""
    (_, kv_pool), (_, mamba), (_, swa) = kit.mha(), kit.mamba(), kit.mamba()
    be = make(server, kv_pool)
    for pool, name in ((mamba, kit.PoolName.MAMBA), (swa, kit.PoolName.SWA)):
        be.register_mem_host_pool_v2(pool, name)
        kit.randomize(pool)
    ks = keys(3, "row3")
    kit.randomize(kv_pool)
    assert be.batch_set_v1(ks, indices(range(3))) == [True] * 3
    put = {kit.PoolName.SWA: ([ks[0], ks[2]], [4, 6]), kit.PoolName.MAMBA: ([ks[0], ks[1]], [8, 9])}
    for name, (ts, slots) in put.items():
        t = kit.PoolTransfer(name=name, host_indices=torch.tensor(slots), keys=ts)
        assert all(be.batch_set_v2([t])[str(name.value)])
    probes = [
        kit.PoolTransfer(
            name=n, keys=["__placeholder__"], hit_policy=kit.PoolHitPolicy.TRAILING_PAGES
        )
        for n in (kit.PoolName.SWA, kit.PoolName.MAMBA)
    ]
    res = be.batch_exists_v2(ks, probes)
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (1, [1])
    assert res.extra_pool_hit_pages == {"kv": 3, "swa": 3, "mamba": 2}  # each pool's own best
    fresh = {name: kit.mamba()[1] for name in put}
    reader = make(server, kit.mha()[1])
    for name, pool in fresh.items():
        reader.register_mem_host_pool_v2(pool, name)
    before = {name: stat(reader, name)["hits"] for name in put}
    # what the controller sends for endpoint 1: each window's last page, ks[0]
    got = reader.batch_get_v2(
        [kit.PoolTransfer(name=n, host_indices=torch.tensor([5]), keys=ks[:1]) for n in put]
    )
    assert got == {"swa": [True], "mamba": [True]}
    for name, (_, slots) in put.items():
        src = swa if name == kit.PoolName.SWA else mamba
        assert kit.page_bytes(fresh[name], 5) == kit.page_bytes(src, slots[0])
        assert stat(reader, name)["hits"] - before[name] == 1  # exactly one page moved
    server.invariants()


def stat(backend, name):
    return backend.client.stats()["namespaces"][backend.bindings[str(name.value)].namespace]
