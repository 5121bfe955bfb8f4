"""Draft / MTP pools as SGLang 0.5.23 registers them: sidecar drafts from
`build_hicache_draft_sidecars` (`build_full_draft_pools`: DRAFT and DRAFT_INDEXER riding on the
KV indices; `build_swa_draft_pools`: DeepSeek-V4's DRAFT_SWA riding on the SWA window), an MTP
draft whose SWA layer uses full-token indices (`build_hybrid_swa_stack`'s DRAFT_SWA entry and
`_mtp_swa_sidecar_specs`), registered with the controller (`register_host_pool_entry`, as
`UnifiedRadixCache.register_sidecar_pool` does); packed MTP layers are in test_dsa_indexer.py.

Stored by the replication rule, on two TP ranks of one sidecar: MLA / DeepSeek-V4 drafts once
(SGLang's controller skips the write on TP rank 1, and rank 1 loads rank 0's pages), MHA drafts
per rank (each rank loads its own pages). Replaced, GPU-only: cudaHostRegister (assembled.py)."""

import pytest

from loadtest.kit.sglang import pools as kit
from loadtest.kit.sglang.pools import PoolHitPolicy, PoolName
from tests.engines.sglang import assembled as asm


class Ranks:
    """Engines (stacks) built per TP rank on one sidecar, detached at the end."""

    def __init__(self, url):
        self.url, self.made = url, []

    def stack(self, rank: int, build, draft, seed: int):
        with asm.tp_rank(rank, 2):
            stack = build(self.url)
            if draft is not None:
                stack = asm.add_draft_sidecars(stack, draft())
        self.made.append(stack)
        asm.fill_all(stack, seed)
        return stack


@pytest.fixture
def ranks(server, unpinned):
    r = Ranks(server.socket_url)
    yield r
    for stack in r.made:
        stack.cc.detach_storage_backend()


def host(stack, name):
    return stack.group.entry_map[PoolName(name)].host_pool


def write(stack, tokens, window):
    """Write back 4 pages (the last `window` pages of the SWA component too, if any)."""
    P = stack.cc.page_size
    kv_idx = stack.group.alloc(len(tokens))
    comp, win = [], None
    if window:
        win = host(stack, "swa").alloc(window * P)
        comp = [asm.trailing(PoolName.SWA, win, asm.hashes(tokens, P)[-window:])]
    return asm.write_back(stack, kv_idx, tokens, comp).completed_tokens, kv_idx, win


def read(stack, tokens, window):
    stack.group.alloc(stack.cc.page_size)  # other slots than the writer's
    comp = [asm.trailing(PoolName.SWA, keys=["__placeholder__"] * window)] if window else []
    return asm.prefetch(stack, tokens, comp)


def same_pages(a, a_idx, b, b_idx, name) -> bool:
    P = a.cc.page_size
    pa, pb = asm.pages_of(a_idx, P), asm.pages_of(b_idx, P)
    assert len(pa) == len(pb)
    return all(
        kit.page_bytes(host(a, name), x) == kit.page_bytes(host(b, name), y)
        for x, y in zip(pa, pb, strict=True)
    )


def namespace(stack, name):
    return stack.cc.storage_backend.bindings[name].namespace


def stored_pages(stack, name):
    backend = stack.cc.storage_backend
    return backend.client.stats()["namespaces"][namespace(stack, name)]["pages"]["host"]


# (target stack, draft device pool, draft pools, host class, SWA window pages, replicated)
FAMILIES = {
    "mla": (
        lambda url: asm.plain_stack(url, asm.mla_pool(2)),
        lambda: asm.mla_pool(1),
        ["draft"],
        "MLATokenToKVPoolHost",
        0,
        True,
    ),
    "dsa": (
        lambda url: asm.dsa_stack(url),
        lambda: asm.dsa_pool(1),
        ["draft", "draft_indexer"],
        "MLATokenToKVPoolHost",
        0,
        True,
    ),
    "deepseek_v4": (
        asm.v4_stack,
        lambda: asm.v4_pool([0], draft=True),
        ["draft_swa"],
        "DeepSeekV4PagedHostPool",
        2,
        True,
    ),
    "mha": (
        lambda url: asm.plain_stack(url, asm.mha_pool(2)),
        lambda: asm.mha_pool(1),
        ["draft"],
        "MHATokenToKVPoolHost",
        0,
        False,
    ),
    "mtp_swa_full_indices": (
        lambda url: asm.swa_stack(url, mtp_draft=full_index_swa_draft()),
        None,
        ["draft_swa"],
        "MHATokenToKVPoolHost",
        2,
        False,
    ),
}


def full_index_swa_draft():
    draft = asm.swa_pool([0], [])
    draft.swa_uses_full_indices = True  # as kv_cache_configurator marks such a draft pool
    return draft


@pytest.mark.parametrize("family", list(FAMILIES))
def test_draft_pools_are_stored_by_the_replication_rule_and_load_byte_exact(ranks, family):
    build, draft, pools, host_class, window, replicated = FAMILIES[family]
    writers = [ranks.stack(r, build, draft, seed=10 + r) for r in (0, 1)]
    readers = [ranks.stack(r, build, draft, seed=20 + r) for r in (0, 1)]
    tokens = list(range(50000, 50000 + 4 * writers[0].cc.page_size))
    for name in pools:
        expected = "DSAIndexerPoolHost" if name == "draft_indexer" else host_class
        assert type(host(writers[0], name)).__name__ == expected
        assert (namespace(writers[0], name) == namespace(writers[1], name)) == replicated
    specs = {str(s.pool_name): s for s in writers[0].specs}
    assert all(name in specs for name in pools)  # registered as the tree registers sidecars
    wrote = [write(w, tokens, window) for w in writers]
    assert wrote[0][0] == len(tokens)
    assert wrote[1][0] == (
        0 if replicated else len(tokens)
    )  # SGLang: TP rank 1 skips replicated pools
    for name in pools:  # once in all (replicated) or once a rank
        pages = 4 if specs[name].indices_from_pool == PoolName.KV else window
        assert [stored_pages(w, name) for w in writers] == [pages, pages]
    for r, reader in enumerate(readers):
        got = read(reader, tokens, window)
        assert got.loaded == len(tokens), (family, r)
        w = 0 if replicated else r  # whose pages this rank must load
        for name in pools:
            kv_derived = specs[name].indices_from_pool == PoolName.KV
            a_idx = wrote[w][1] if kv_derived else wrote[w][2]
            b_idx = got.host_indices if kv_derived else got.comp[0].host_indices
            assert same_pages(writers[w], a_idx, reader, b_idx, name), (family, r, name)
            if not replicated and r == 1:  # rank 1's own shard, not rank 0's
                assert not same_pages(
                    writers[0], wrote[0][1 if kv_derived else 2], reader, b_idx, name
                )
    assert all(s.cc.storage_backend.failures == 0 for s in writers + readers)


def test_an_mha_draft_beside_an_mla_target_is_per_rank_so_rank_1_misses(ranks):
    """SGLang 0.5.23 backs up an MHA draft on TP ranks > 0 only for Mooncake (should_backup),
    so with any other backend rank 1 never writes its shard. The draft namespace is per rank
    (its heads are TP-sharded): rank 1 gets a miss, never rank 0's heads (docs/sglang.md)."""
    build = lambda url: asm.plain_stack(url, asm.mla_pool(2))  # noqa: E731
    w0, w1 = (ranks.stack(r, build, lambda: asm.mha_pool(1), seed=30 + r) for r in (0, 1))
    assert type(host(w0, "draft")).__name__ == "MHATokenToKVPoolHost"
    assert namespace(w0, "kv") == namespace(w1, "kv") and namespace(w0, "draft") != namespace(
        w1, "draft"
    )
    assert not w1.cc.should_backup(
        kit.PoolTransfer(name=PoolName.DRAFT)
    )  # SGLang's rule for "dynamic"
    tokens = list(range(60000, 60000 + 4 * asm.SMALL_P))
    done0, kv_idx, _ = write(w0, tokens, 0)
    assert done0 == len(tokens) and write(w1, tokens, 0)[0] == 0
    assert [s.hit_policy for s in w1.specs if s.pool_name == PoolName.DRAFT] == [
        PoolHitPolicy.ALL_PAGES
    ]
    r1 = ranks.stack(1, build, lambda: asm.mha_pool(1), seed=32)
    assert (
        read(r1, tokens, 0).op.storage_hit_count == 0
    )  # the draft gates: a miss, not rank 0's heads
    r0 = ranks.stack(0, build, lambda: asm.mha_pool(1), seed=33)
    got = read(r0, tokens, 0)
    assert got.loaded == len(tokens)
    assert all(same_pages(w0, kv_idx, r0, got.host_indices, name) for name in ("kv", "draft"))


def test_a_draft_registered_after_attach_arrives_through_v2_alone(ranks, caplog):
    """Draft sidecars are registered once the target's cache is attached: the controller hands
    them to register_mem_host_pool_v2 and does not fire on_host_pools_registered again."""
    caplog.set_level("INFO", logger="kv_sidecar.sglang")
    stack = ranks.stack(
        0, lambda url: asm.plain_stack(url, asm.mla_pool(2)), lambda: asm.mla_pool(1), seed=1
    )
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("kv-sidecar pools:")
    ]
    assert lines == ["kv-sidecar pools: kv (zero copy)"]
    assert stack.cc.storage_backend.bindings["draft"].buffer_id  # registered, zero copy
