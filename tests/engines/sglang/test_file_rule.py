"""Where SGLang 0.5.23's HiCacheFile `batch_exists_v2` stands against the sidecar's hit rule
(issue 12). Its hit is already the intersection of legal endpoints (the `min` defect of
SGLang issue #39147 is HF3FS's in 0.5.23), and so is its `restorable_prefix_pages`. It
differs in the per-pool report: once no endpoint is common it stops looking, so the pools
after that one are left out, where the sidecar reports every pool's own best endpoint.
A change on either side fails here."""

import asyncio

import pytest
import torch

from loadtest.kit.sglang import pools as h
from pools import Arena, HostPool
from sidecar.buffers import Sources
from sidecar.hybrid import ExtraPool, batch_exists
from sidecar.spec import parse_spec
from sidecar.store import Store

KEYS = [f"{i:064x}" for i in range(3)]
W1 = h.PoolHitPolicy.TRAILING_PAGES
# (pool, pages present, policy); three KV pages; trailing windows of 1 page
ROWS = {
    "same": [("swa", [2], W1), ("mamba", [2], W1)],  # {3} & {3}: 3
    "disjoint": [
        ("swa", [2], W1),
        ("mamba", [1], W1),
        ("indexer", [0, 1, 2], h.PoolHitPolicy.ALL_PAGES),
    ],
    "holes": [("swa", [0, 2], W1), ("mamba", [0, 1], W1)],  # {1, 3} & {1, 2}: 1
}


def hicache_file(tmp_path, pools):
    cfg = h.HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="m",
        extra_config={},
    )
    backend = h.HiCacheFile(cfg, file_path=str(tmp_path))
    page = torch.zeros(16, dtype=torch.uint8)
    for k in KEYS:
        assert backend.set(k, page)
    for name, pages, _ in pools:  # HiCacheFile keeps an extra pool's page as "{key}.{pool}"
        for i in pages:
            assert backend.set(f"{KEYS[i]}.{name}", page)
    transfers = [
        h.PoolTransfer(name=h.PoolName(name), keys=["__placeholder__"], hit_policy=policy)
        for name, _, policy in pools
    ]
    return backend.batch_exists_v2(KEYS, transfers)


def sidecar(pools):
    arena = Arena(4 << 20)
    store = Store(HostPool(arena, 64 << 10), None, Sources(["/dev/shm"]))
    try:
        for name, pages in [("kv", range(3))] + [(n, p) for n, p, _ in pools]:
            store.put_namespace(name, parse_spec({"page_bytes": 512}))
            pool = store.namespace(name).pool
            for i in pages:
                pool.commit(pool.reserve(KEYS[i]))
        extra = [ExtraPool(n, policy.value) for n, _, policy in pools]
        return asyncio.run(batch_exists(store, KEYS, "kv", extra, restorable=True))
    finally:
        arena.close()


@pytest.mark.parametrize("row", list(ROWS))
def test_hicache_file_against_the_sidecar(tmp_path, row):
    ref, ours = hicache_file(tmp_path, ROWS[row]), sidecar(ROWS[row])
    assert ref.kv_hit_pages == ours["hit"] == {"same": 3, "disjoint": 0, "holes": 1}[row]
    assert ref.restorable_prefix_pages == ours["restorable"]
    reported = {str(getattr(k, "value", k)): n for k, n in ref.extra_pool_hit_pages.items()}
    ours_nonzero = {"kv": 3, **{n: b for n, b in ours["pools"].items() if b}}
    if row == "disjoint":  # the difference: HiCacheFile stops at mamba, the indexer goes unreported
        assert reported == {"kv": 3, "swa": 3, "mamba": 2}
        assert ours_nonzero == {**reported, "indexer": 3}
    else:
        assert reported == ours_nonzero
