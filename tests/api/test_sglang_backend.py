"""The SGLang HiCache backend, driven with SGLang's own storage interface classes."""
import hashlib
import time
import subprocess
import sys

import pytest
import torch

from tests import sglang_env
from tests.api.sglang_pools_replica import MambaHostPool, MHAHostPool, MLAHostPool
from tests.conftest import ROOT

h = sglang_env.load()
from api.engine.sglang_backend import SidecarHiCacheStorage  # noqa: E402  (after SGLang's types)
from api.engine.sglang_pools import namespace_name, namespace_spec  # noqa: E402

P = 4


def config(url, tp=0, tp_size=1, mla=False, model="Qwen/Qwen3-8B", **extra):
    return h.HiCacheStorageConfig(
        tp_rank=tp, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model, extra_config={"backend_name": "kv_sidecar", "interface_v1": 1,
                                        "sidecar_url": url, "allocator": "shm", **extra})


def dynamic_backend(cfg):
    """SGLang's own factory, as `--hicache-storage-backend dynamic` runs it: it imports the
    module, checks the HiCacheStorage base and constructs `cls(storage_config, kwargs)`."""
    factory = sglang_env.load_factory()
    backend = factory.create_backend("dynamic", cfg, None)
    assert isinstance(backend, h.HiCacheStorage)
    return backend


def make(server, pool, **kw):
    kw.setdefault("module_path", "api.engine.sglang_backend")
    cfg = config(server.url, class_name="SidecarHiCacheStorage", **kw)
    backend = dynamic_backend(cfg)
    backend.register_mem_pool_host(pool)
    return backend


def fill(pool, pages):
    for p in pages:
        page = pool.get_data_page(p * pool.page_size)
        rnd = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8)
        pool.set_from_flat_data_page(p * pool.page_size, rnd)


def indices(pages, page_size=P):
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])


def keys(n, salt="x"):
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


POOLS = {
    "page_first": lambda: MHAHostPool("page_first", 64, P),
    "page_first_direct": lambda: MHAHostPool("page_first_direct", 64, P),
    "layer_first": lambda: MHAHostPool("layer_first", 64, P),
    "mla": lambda: MLAHostPool(64, P),
}


@pytest.mark.parametrize("layout", list(POOLS))
def test_v1_zero_copy_round_trip_each_layout(server, layout):
    a_pool, b_pool = POOLS[layout](), POOLS[layout]()
    a, b = make(server, a_pool, mla=layout == "mla"), make(server, b_pool, mla=layout == "mla")
    assert a.bindings["kv"].buffer_id is not None  # registered as a shared buffer: zero copy
    ks = keys(6, layout)
    fill(a_pool, range(1, 7))
    assert a.batch_set_v1(ks, indices(range(1, 7))) == [True] * 6
    assert b.batch_exists(ks + ["0" * 64]) == 6
    dst = [9, 3, 12, 4, 8, 15]
    assert b.batch_get_v1(ks, indices(dst)) == [True] * 6
    for src_page, dst_page in zip(range(1, 7), dst):
        assert b_pool.page_bytes(dst_page) == a_pool.page_bytes(src_page)
    assert b.batch_get_v1(["f" * 64], indices([2])) == [False]
    assert a.batch_set_v1(ks[:2], indices([1])) == [False, False]  # wrong index count
    server.invariants()


def test_two_engine_processes_share_pages(server):
    script = f"""
import sys, hashlib, torch
sys.path.insert(0, {ROOT!r})
from tests import sglang_env
h = sglang_env.load()
from tests.api.test_sglang_backend import make_remote
print(make_remote({server.url!r}, sys.argv[1]))
"""
    out_a = subprocess.run([sys.executable, "-c", script, "set"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    out_b = subprocess.run([sys.executable, "-c", script, "get"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out_a.returncode == 0 and out_b.returncode == 0, out_a.stderr + out_b.stderr
    digest_a, digest_b = out_a.stdout.split()[-1], out_b.stdout.split()[-1]
    assert digest_a == digest_b and digest_a != "missing"


def make_remote(url, op):
    """One engine process: set 8 pages, or get them into other slots; prints a digest."""
    pool = MHAHostPool("page_first", 64, P)
    backend = dynamic_backend(config(url, module_path="api.engine.sglang_backend", class_name="SidecarHiCacheStorage"))
    backend.register_mem_pool_host(pool)
    ks, pages = keys(8, "proc"), list(range(8)) if op == "set" else list(range(8, 16))
    if op == "set":
        torch.manual_seed(7)
        fill(pool, pages)
        assert backend.batch_set_v1(ks, indices(pages)) == [True] * 8
    elif backend.batch_get_v1(ks, indices(pages)) != [True] * 8:
        return "missing"
    return hashlib.sha256(b"".join(pool.page_bytes(p) for p in pages)).hexdigest()


def test_v2_rules_on_kv_and_mamba(server):
    kv_pool, mamba = MHAHostPool("page_first", 64, P), MambaHostPool(16)
    be = make(server, kv_pool)
    be.register_mem_host_pool_v2(kv_pool, h.PoolName.KV)
    be.register_mem_host_pool_v2(mamba, h.PoolName.MAMBA)
    assert be.bindings["mamba"].buffer_id is None  # separate allocations: inline pages
    ks = keys(5, "hyb")
    fill(kv_pool, range(5))
    fill(mamba, range(16))
    assert be.batch_set_v1(ks, indices(range(5))) == [True] * 5
    t = h.PoolTransfer(name=h.PoolName.MAMBA, host_indices=torch.tensor([3, 7]), keys=[ks[2], ks[4]])
    assert be.batch_set_v2([t]) == {"mamba": [True, True]}
    probe = h.PoolTransfer(name=h.PoolName.MAMBA, keys=["__placeholder__"],
                           hit_policy=h.PoolHitPolicy.TRAILING_PAGES)
    res = be.batch_exists_v2(ks, [probe])
    assert (res.kv_hit_pages, res.extra_pool_hit_pages) == (5, {"kv": 5, "mamba": 5})
    res = be.batch_exists_v2(ks[:4], [probe])    # Mamba state exists at page 3, not 4
    assert (res.kv_hit_pages, res.extra_pool_hit_pages) == (3, {"kv": 4, "mamba": 3})
    swa = h.PoolTransfer(name=h.PoolName.SWA, keys=["__placeholder__"] * 2,
                         hit_policy=h.PoolHitPolicy.TRAILING_PAGES)
    assert be.batch_exists_v2(ks, [swa]).kv_hit_pages == 0  # never registered: 0
    fresh = MambaHostPool(16)
    be2 = make(server, MHAHostPool("page_first", 64, P))
    be2.register_mem_host_pool_v2(fresh, h.PoolName.MAMBA)
    got = be2.batch_get_v2([h.PoolTransfer(name=h.PoolName.MAMBA, host_indices=torch.tensor([9, 11]),
                                           keys=[ks[2], ks[4]])])
    assert got == {"mamba": [True, True]}
    assert fresh.page_bytes(9) == mamba.page_bytes(3) and fresh.page_bytes(11) == mamba.page_bytes(7)
    server.invariants()


def test_generic_path_and_draft_keys(server):
    be = make(server, MHAHostPool("page_first", 64, P))
    pages = [torch.randint(0, 256, (512,), dtype=torch.uint8) for _ in range(3)]
    ks = keys(2, "gen") + [keys(1, "d")[0] + ".draft"]
    assert be.batch_set(ks, pages) is True
    assert be.exists(ks[0]) and be.exists(ks[2]) and not be.exists("0" * 64)
    targets = [torch.zeros(512, dtype=torch.uint8) for _ in range(3)]
    got = be.batch_get(ks, targets)
    assert all(g is t for g, t in zip(got, targets))
    assert all(torch.equal(a, b) for a, b in zip(pages, targets))
    assert be.get("1" * 64, torch.zeros(512, dtype=torch.uint8)) is None


def test_never_raises_and_recovers_after_a_sidecar_restart(spawn):
    proc = spawn("--host-pool", "32MiB", "--no-file-tier").wait_ready()
    pool = MHAHostPool("page_first", 64, P)
    cfg = config(proc.url, module_path="api.engine.sglang_backend", class_name="SidecarHiCacheStorage",
                 sidecar_timeout=2)
    be = dynamic_backend(cfg)
    be.register_mem_pool_host(pool)
    ks = keys(3, "r")
    fill(pool, range(3))
    assert be.batch_set_v1(ks, indices(range(3))) == [True] * 3
    proc.kill()
    assert be.batch_exists(ks) == 0
    assert be.batch_set_v1(ks, indices(range(3))) == [False] * 3
    assert be.batch_get_v1(ks, indices(range(3))) == [False] * 3
    assert be.batch_exists_v2(ks, []).kv_hit_pages == 0
    assert be.batch_get_v2([h.PoolTransfer(name=h.PoolName.MAMBA, keys=ks)]) == {"mamba": [False] * 3}
    assert be.get(ks[0], torch.zeros(8, dtype=torch.uint8)) is None and be.set("k", torch.zeros(8)) is False
    assert be.failures > 0
    again = spawn("--host-pool", "32MiB", "--no-file-tier", port=proc.port)  # same address
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
    base = config("http://127.0.0.1:1")
    spec = namespace_spec(base, "kv", 4096, "page_first", "bfloat16", 64)
    assert namespace_name(base, "kv", spec) == namespace_name(config("http://x:2"), "kv",
                                                              namespace_spec(config("http://x:2"), "kv", 4096, "page_first", "bfloat16", 64))
    names = {namespace_name(c, "kv", namespace_spec(c, "kv", pb, lay, dt, 64)) for c, pb, lay, dt in [
        (base, 4096, "page_first", "bfloat16"), (config("u", tp=1, tp_size=2), 4096, "page_first", "bfloat16"),
        (config("u", model="other"), 4096, "page_first", "bfloat16"), (base, 8192, "page_first", "bfloat16"),
        (base, 4096, "layer_first", "bfloat16"), (base, 4096, "page_first", "float8"),
        (config("u", sidecar_scope="lora-a"), 4096, "page_first", "bfloat16")]}
    assert len(names) == 7                 # any difference keeps engines apart
    mla0, mla1 = config("u", tp=0, tp_size=2, mla=True), config("u", tp=1, tp_size=2, mla=True)
    kv = [namespace_name(c, "kv", namespace_spec(c, "kv", 64, "page_first")) for c in (mla0, mla1)]
    mamba = [namespace_name(c, "mamba", namespace_spec(c, "mamba", 64, "page_first")) for c in (mla0, mla1)]
    assert kv[0] == kv[1] and mamba[0] != mamba[1]   # replicated KV shared, Mamba per rank


def test_parity_with_sglang_hicache_file(server, tmp_path):
    """The same set / exists / get sequence on SGLang's HiCacheFile and on the sidecar."""
    HiCacheFile = sglang_env.load_file_backend()
    cfg = config(server.url)
    ref = HiCacheFile(cfg, file_path=str(tmp_path / "hicache"))
    ours = make(server, MHAHostPool("page_first", 64, P), interface_v1=0)  # HiCacheFile's path
    ks = keys(6, "parity")
    page = ours.bindings["kv"].page_bytes  # the flat page of this host pool
    vals = {k: torch.randint(0, 256, (page,), dtype=torch.uint8) for k in ks}
    ops = [("exists", ks[0]), ("set", ks[0]), ("exists", ks[0]), ("set", ks[0]), ("get", ks[0]),
           ("get", ks[1]), ("batch_set", ks[1:4]), ("batch_exists", ks), ("batch_exists", ks[:3]),
           ("get", ks[2]), ("exists", ks[5]), ("batch_get", ks[:5])]
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
    kv_pool, mamba, swa = MHAHostPool("page_first", 64, P), MambaHostPool(16), MambaHostPool(16)
    be = make(server, kv_pool)
    for pool, name in ((mamba, h.PoolName.MAMBA), (swa, h.PoolName.SWA)):
        be.register_mem_host_pool_v2(pool, name)
        fill(pool, range(16))
    ks = keys(3, "row3")
    fill(kv_pool, range(3))
    assert be.batch_set_v1(ks, indices(range(3))) == [True] * 3
    put = {h.PoolName.SWA: ([ks[0], ks[2]], [4, 6]), h.PoolName.MAMBA: ([ks[0], ks[1]], [8, 9])}
    for name, (ts, slots) in put.items():
        assert all(be.batch_set_v2([h.PoolTransfer(name=name, host_indices=torch.tensor(slots), keys=ts)])[name])
    probes = [h.PoolTransfer(name=n, keys=["__placeholder__"], hit_policy=h.PoolHitPolicy.TRAILING_PAGES)
              for n in (h.PoolName.SWA, h.PoolName.MAMBA)]
    res = be.batch_exists_v2(ks, probes)
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (1, [1])
    assert res.extra_pool_hit_pages == {"kv": 3, "swa": 3, "mamba": 2}  # each pool's own best
    fresh = {name: MambaHostPool(16) for name in put}
    reader = make(server, MHAHostPool("page_first", 64, P))
    for name, pool in fresh.items():
        reader.register_mem_host_pool_v2(pool, name)
    before = {name: stat(reader, name)["hits"] for name in put}
    # what the controller sends for endpoint 1: each window's last page, ks[0]
    got = reader.batch_get_v2([h.PoolTransfer(name=n, host_indices=torch.tensor([5]), keys=ks[:1])
                               for n in put])
    assert got == {"swa": [True], "mamba": [True]}
    for name, (_, slots) in put.items():
        src = swa if name == h.PoolName.SWA else mamba
        assert fresh[name].page_bytes(5) == src.page_bytes(slots[0])
        assert stat(reader, name)["hits"] - before[name] == 1  # exactly one page moved
    server.invariants()


def stat(backend, name):
    return backend.client.stats()["namespaces"][backend.bindings[str(name)].namespace]
