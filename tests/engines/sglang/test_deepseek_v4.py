"""DeepSeek-V4 through SGLang's own `_DeepSeekV4Strategy` (build_deepseek_v4_hicache_stack) on
a small DeepSeekV4TokenToKVPool (layers: SWA-only, C4, C128, a C2 and a C1 source): every
host pool the assembler makes, with the hit policies of the sidecar specs it returns, moved
by its HybridCacheController; the hit the controller computes equals the brute-force rule.
Replaced, GPU-only: cudaHostRegister (assembled.py)."""

import pytest

from loadtest.kit.sglang import pools as kit
from loadtest.kit.sglang.pools import PoolHitPolicy, PoolName, PoolTransfer
from tests.engines.sglang import assembled as asm

P = asm.V4_P
ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES
KV_DERIVED = [
    "deepseek_v4_c1",
    "deepseek_v4_c1_indexer",
    "deepseek_v4_c2",
    "deepseek_v4_c2_indexer",
    "deepseek_v4_c4",
    "deepseek_v4_c4_indexer",
    "deepseek_v4_c128",
]
SWA_DERIVED = ["deepseek_v4_c4_state", "deepseek_v4_c4_indexer_state"]
WINDOW = 2  # pages of the SWA component's window (its transfer's key count)


@pytest.fixture
def stacks(server, unpinned):
    made = []

    def make(seed: int):
        stack = asm.v4_stack(server.socket_url)
        asm.fill_all(stack, seed)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.cc.detach_storage_backend()


def host(stack, name):
    return stack.group.entry_map[PoolName(name)].host_pool


def test_every_pool_the_assembler_makes_with_its_hit_policy(stacks):
    stack = stacks(1)
    kinds = {str(e.name): type(e.host_pool).__name__ for e in stack.group.entries}
    assert kinds == {
        "kv": "LogicalHostPool",
        "swa": "DeepSeekV4PagedHostPool",
        **{n: "DeepSeekV4PagedHostPool" for n in KV_DERIVED},
        **{n: "DeepSeekV4StateHostPool" for n in SWA_DERIVED},
    }
    specs = {str(s.pool_name): (str(s.indices_from_pool), s.hit_policy) for s in stack.specs}
    assert specs == {
        **{n: ("kv", ALL) for n in KV_DERIVED},
        **{n: ("swa", TRAILING) for n in SWA_DERIVED},
    }
    # not made on this (CUDA-path) config: *_rope needs unified fp8 KV (ROCm only), *_indexer_scale
    # the FP4 aiter/NPU indexer split; C128 state is never registered with HiCache
    assert not {
        "deepseek_v4_c4_rope",
        "deepseek_v4_c128_rope",
        "deepseek_v4_c4_indexer_scale",
        "deepseek_v4_c128_state",
    } & set(kinds)
    backend = stack.cc.storage_backend
    assert sorted(backend.bindings) == sorted(kinds)
    assert (
        backend.bindings["kv"].logical and backend.bindings["kv"].page_bytes == 512
    )  # marker pages
    assert all(b.buffer_id for b in backend.bindings.values())  # every pool zero copy (memfd)
    for name, binding in backend.bindings.items():
        spec = backend.client.get_namespace(binding.namespace)["spec"]
        assert spec["replicated"], name  # DeepSeek-V4 is rank-replicated: stored once
        assert spec["page_bytes"] == (
            512 if name == "kv" else len(kit.page_bytes(host(stack, name), 0))
        )


def write(stack, tokens):
    """Two write-backs as the tree makes them: the whole span (window = its last 2 pages),
    then its first half (window = pages 0, 1). Returns {key index: SWA slot page}."""
    n = len(tokens) // P
    kv_idx, where = stack.group.alloc(len(tokens)), {}
    for end in (n, n // 2):
        win = host(stack, "swa").alloc(WINDOW * P)
        keys = asm.hashes(tokens[: end * P], P)
        window = [asm.trailing(PoolName.SWA, win, keys[-WINDOW:])]
        done = asm.write_back(stack, kv_idx[: end * P], tokens[: end * P], window)
        assert done.completed_tokens == end * P
        where.update(zip(range(end - WINDOW, end), asm.pages_of(win, P), strict=True))
    return kv_idx, where


def rule(stack, keys, extra_specs=None) -> list[int]:
    pools = [(asm.presence(stack, "swa", keys), TRAILING, WINDOW)]
    for spec in extra_specs or stack.specs:
        pools.append((asm.presence(stack, spec.pool_name, keys), spec.hit_policy, WINDOW))
    return asm.brute_force(asm.presence(stack, "kv", keys), pools)


def assert_loaded(a, b, got, kv_idx, where):
    """Every pool's pages in engine B equal engine A's: KV-derived at the KV slots, the SWA
    window and its states at the window slots."""
    hit = got.op.storage_hit_count // P
    for name in KV_DERIVED:
        for pa, pb in zip(
            asm.pages_of(kv_idx, P)[:hit], asm.pages_of(got.host_indices, P), strict=True
        ):
            assert kit.page_bytes(host(b, name), pb) == kit.page_bytes(host(a, name), pa), name
    win_b = asm.pages_of(got.comp[0].host_indices, P)
    assert len(win_b) == min(WINDOW, hit)
    for name in ["swa"] + SWA_DERIVED:
        for i, pb in zip(range(hit - len(win_b), hit), win_b, strict=True):
            assert kit.page_bytes(host(b, name), pb) == kit.page_bytes(host(a, name), where[i]), (
                name,
                i,
            )


def test_round_trip_of_every_pool_byte_exact(stacks):
    a, b = stacks(2), stacks(3)
    tokens = list(range(20000, 20000 + 4 * P))
    kv_idx, where = write(a, tokens)
    b.group.alloc(P)
    host(b, "swa").alloc(P)  # B loads into other slots
    got = asm.prefetch(b, tokens, [asm.trailing(PoolName.SWA)])
    assert got.op.storage_hit_count == got.loaded == len(tokens)
    assert got.pool_hits["swa"] == WINDOW and all(got.pool_hits[n] == WINDOW for n in SWA_DERIVED)
    assert asm.pages_of(got.host_indices, P) != asm.pages_of(kv_idx, P)
    assert_loaded(a, b, got, kv_idx, where)
    assert a.cc.storage_backend.failures == b.cc.storage_backend.failures == 0


# pages removed from the sidecar after the writes, (pool, page index) each -> legal endpoints
CASES = {
    "all stored": ([], [1, 2, 3, 4]),
    "c4 page 2": ([("deepseek_v4_c4", 2)], [1, 2]),
    "c128 page 0": ([("deepseek_v4_c128", 0)], []),
    "swa page 1": ([("swa", 1)], [1, 4]),  # a hole: 4 is legal, 3 and 2 not
    "c4 state page 3": ([("deepseek_v4_c4_state", 3)], [1, 2, 3]),
    "swa pages 0, 3": ([("swa", 0), ("swa", 3)], [3]),
    "kv marker page 2": ([("kv", 2)], [1, 2]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_controller_hit_equals_the_brute_force_rule(stacks, case):
    a, b = stacks(4), stacks(5)
    base = 30000 + 1000 * list(CASES).index(case)
    tokens = list(range(base, base + 4 * P))
    keys = asm.hashes(tokens, P)
    kv_idx, where = write(a, tokens)
    backend = a.cc.storage_backend
    for pool, page in CASES[case][0]:
        assert backend.client.delete(backend.bindings[pool].namespace, [keys[page]]) == 1
    legal = rule(b, keys)
    assert legal == CASES[case][1]
    got = asm.prefetch(b, tokens, [asm.trailing(PoolName.SWA)])
    assert got.op.storage_hit_count == max(legal, default=0) * P  # SGLang's controller == the rule
    assert got.loaded == got.op.storage_hit_count
    if legal:
        assert got.op.pool_storage_result.restorable_prefix_pages == legal
        assert_loaded(a, b, got, kv_idx, where)


@pytest.mark.parametrize("deleted,verdict", [(None, 4), (3, 2), (2, 2), (1, 0)])
def test_a_block_groups_pool_reports_whole_groups_and_never_gates(stacks, deleted, verdict):
    """No 0.5.23 builder emits BLOCK_GROUPS (and SidecarPoolSpec cannot carry its geometry), so
    the transfer is made as a component would make it: C128 as blocks of 2 pages in groups of
    2 keys, its own verdict = the pages its leading complete groups cover."""
    a, b = stacks(6), stacks(7)
    tokens = list(range(40000 + 1000 * (deleted or 0), 40000 + 1000 * (deleted or 0) + 4 * P))
    keys = asm.hashes(tokens, P)
    write(a, tokens)
    if deleted is not None:
        backend = a.cc.storage_backend
        assert (
            backend.client.delete(backend.bindings["deepseek_v4_c128"].namespace, [keys[deleted]])
            == 1
        )
    b = b._replace(specs=[s for s in b.specs if s.pool_name != PoolName.DEEPSEEK_V4_C128])
    blocks = PoolTransfer(
        name=PoolName.DEEPSEEK_V4_C128,
        hit_policy=PoolHitPolicy.BLOCK_GROUPS,
        block_pages=2,
        group_pages=2,
    )
    present = asm.presence(b, "deepseek_v4_c128", keys)
    run = present.index(False) if False in present else len(present)
    assert run // 2 * 2 == verdict  # the brute-force verdict
    got = asm.prefetch(b, tokens, [asm.trailing(PoolName.SWA)], extra=[blocks])
    assert got.op.storage_hit_count == max(rule(b, keys, b.specs)) * P == 4 * P  # never gates
    assert got.op.query_pool_hit_pages.get(PoolName.DEEPSEEK_V4_C128, 0) == verdict


def test_unified_fp8_rope_pools_and_a_page_below_512_bytes(server, unpinned, monkeypatch):
    """DeepSeek-V4's fp8 unified_kv layout: the assembler adds the C4 / C128 rope pools (bf16
    halves of each compressed row, riding on the KV indices). At SGLang's 256-token page a C128
    rope page is 256 B, below the sidecar's 512: the backend stores it padded (inline) and
    loads it back exact. Replaced: the unified_kv gate (`is_unified_kv_triton`), which is True
    only on ROCm, where SGLang's triton attention for this layout runs; pools are CPU tensors."""
    from sglang.srt.layers.attention.dsv4 import unified_kv_gate

    monkeypatch.setattr(unified_kv_gate, "is_unified_kv_triton", lambda: True)
    a, b = (asm.v4_stack(server.socket_url, unified=True) for _ in range(2))
    try:
        for seed, stack in enumerate((a, b)):
            asm.fill_all(stack, 60 + seed)
        pools = [
            "deepseek_v4_c4",
            "deepseek_v4_c4_rope",
            "deepseek_v4_c4_indexer",
            "deepseek_v4_c128",
            "deepseek_v4_c128_rope",
        ]
        assert sorted(str(e.name) for e in a.group.entries) == sorted(["kv", *pools])
        assert {str(s.pool_name): s.hit_policy for s in a.specs} == {n: ALL for n in pools}
        rope = a.cc.storage_backend.bindings["deepseek_v4_c128_rope"]
        assert (rope.page_bytes, rope.stored_bytes, rope.buffer_id) == (
            256,
            512,
            None,
        )  # padded, inline
        spec = a.cc.storage_backend.client.get_namespace(rope.namespace)["spec"]
        assert spec["page_bytes"] == 512 and spec["layout"] == "page_first;page256"
        tokens = list(range(70000, 70000 + 4 * P))
        keys = asm.hashes(tokens, P)
        kv_idx = a.group.alloc(len(tokens))
        assert asm.write_back(a, kv_idx, tokens).completed_tokens == len(tokens)
        b.group.alloc(P)
        got = asm.prefetch(b, tokens)
        assert got.op.storage_hit_count == got.loaded == len(tokens)
        for name in pools:
            for pa, pb in zip(
                asm.pages_of(kv_idx, P), asm.pages_of(got.host_indices, P), strict=True
            ):
                assert kit.page_bytes(host(b, name), pb) == kit.page_bytes(host(a, name), pa), name
        # the padded pool gates like any all_pages pool
        assert a.cc.storage_backend.client.delete(rope.namespace, [keys[1]]) == 1
        assert asm.prefetch(b, tokens, rid="again").op.storage_hit_count == 1 * P
        assert a.cc.storage_backend.failures == b.cc.storage_backend.failures == 0
    finally:
        for stack in (a, b):
            stack.cc.detach_storage_backend()
