"""The kv-sidecar UnifiedCacheLinker under SGLang 0.5.23's own UnifiedRadixCache, on CPU device
pools, against a live sidecar: SGLang's `create_tree_cache` loads it from the documented config,
its `UnifiedCacheLinkerWrapper` drives it, and the scheduler's steps are taken in order
(loadtest/kit/sglang/linker.py names them). Pages are compared byte for byte."""

import pytest
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.unified_cache.components import ComponentType

from api.engine.sglang_linker_pools import device_pool_group
from api.sglang_linker import SidecarLinker
from loadtest.kit.sglang import linker as lk
from loadtest.kit.sglang import pools as kit  # SGLang's CPU settings before anything imports SGLang
from loadtest.kit.sglang.linker import P
from tests.conftest import Gate


@pytest.fixture
def engines(server):
    made = []

    def make(kind="kv", url=None, **extra):
        eng = lk.engine(url or server.socket_url, kind, **extra)
        lk.scramble(eng, seed=100 + len(made))  # no two engines' pools hold the same bytes
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def written(eng, tokens, seed):
    req, slots = lk.compute(eng, tokens, seed)
    lk.settle(eng)
    return slots


def restorable(eng, tokens) -> list[int]:
    """What the linker told the tree for a request of `tokens` (its lookup's answer), checking
    that the lookup took one round trip to the sidecar."""
    answers, calls = [], []
    real, request = eng.linker.lookup, eng.linker.lookups.request

    def spy(rid, transfers):
        answers.append(real(rid, transfers))
        return answers[-1]

    eng.linker.lookup = spy
    eng.linker.lookups.request = lambda *a, **kw: calls.append(a[1]) or request(*a, **kw)
    try:
        lk.match(eng, tokens)
    finally:
        del eng.linker.lookup, eng.linker.lookups.request
    assert len(answers) == 1 and calls == ["/v1/batch/exists"]
    return answers[-1]


def test_sglang_builds_the_linker_from_the_documented_config(server, engines):
    eng = engines("kv")
    linker = eng.linker
    assert isinstance(linker, SidecarLinker) and eng.cache.linker is not None
    assert eng.cache.write_through_threshold == 1  # the wrapper's: every insert offloads
    assert eng.kvcache.layer_transfer_counter is linker.layer_done_counter  # registry's wiring
    assert eng.worker.hicache_layer_transfer_counter is linker.layer_done_counter
    ((name, ns),) = linker.names.items()
    assert (
        name == PoolName.KV and linker.pool_source == "kv-sidecar"
    )  # SGLang's assembler refuses MHA
    spec = server.client().get_namespace(ns)["spec"]
    assert spec["pool"] == "kv" and spec["page_bytes"] == 2 * lk.LAYERS * P * 2 * 16 * 2
    assert spec["layout"].startswith("linker;") and not spec["replicated"]
    (buf,) = server.client().request("GET", f"/v1/namespaces/{ns}/buffers")[1]["buffers"]
    assert buf["mode"] == "mmap" and buf["size"] == linker.staging.size  # the staging memfd, lent


@pytest.mark.parametrize("kind", ["kv", "mla"])
def test_kv_pages_written_by_one_engine_load_into_another(engines, kind):
    a, b = engines(kind), engines(kind)
    tokens = lk.tokens_of(1000, 5)
    src = written(a, tokens, seed=1)
    assert a.linker.stats["pages_offloaded"] == 5
    assert restorable(b, tokens) == [1, 2, 3, 4, 5]
    req, m = lk.match(b, tokens)
    assert (m.device_prefix_len, m.host_hit_length) == (0, 5 * P)
    got = lk.load(b, req)
    assert got.failed == [] and got.tokens == 5 * P
    assert lk.digest(lk.kv_buffers(b), got.slots) == lk.digest(lk.kv_buffers(a), src)
    assert lk.digest(lk.kv_buffers(b), [100]) != lk.digest(
        lk.kv_buffers(a), [100]
    )  # the rest stays b's
    assert (
        b.linker.stats["pages_loaded"] == 5
        and a.linker.stats["failures"] == b.linker.stats["failures"] == 0
    )


def test_a_prompt_larger_than_the_staging_moves_in_rounds(engines):
    a, b = engines("kv", staging_pages=2), engines("kv", staging_pages=2)
    assert a.linker.layouts[PoolName.KV].slots == 2
    tokens = lk.tokens_of(6000, 5)
    src = written(a, tokens, seed=7)  # 3 sets: pages 0-1, 2-3, 4
    req, _ = lk.match(b, tokens)
    got = lk.load(b, req)  # 3 gets
    assert got.failed == [] and got.tokens == 5 * P
    assert lk.digest(lk.kv_buffers(b), got.slots) == lk.digest(lk.kv_buffers(a), src)


def test_nodes_queued_behind_a_set_in_flight_go_in_one_set(engines):
    """The offload thread is held in its first set (a gate, not a sleep) while three more
    nodes queue: they go in one merged set, and every node's pages load byte for byte."""
    a, b = engines("kv"), engines("kv")
    sets = []
    real = a.linker.client.batch_set
    a.linker.client.batch_set = lambda items: sets.append(len(items[0]["keys"])) or real(items)
    gate = Gate(a.linker.client, "batch_set")
    prompts = [lk.tokens_of(10_000 * (i + 1), 3) for i in range(4)]
    src = [lk.compute(a, prompts[0], seed=20)[1]]
    assert gate.entered.wait(30)
    src += [lk.compute(a, t, seed=21 + i)[1] for i, t in enumerate(prompts[1:])]
    gate.open()
    lk.settle(a)
    assert sets == [3, 9] and a.linker.stats["pages_offloaded"] == 12
    assert a.linker.stats["offload_failures"] == 0
    for tokens, slots in zip(prompts, src, strict=True):
        req, _ = lk.match(b, tokens)
        got = lk.load(b, req)
        assert got.failed == [] and lk.digest(lk.kv_buffers(b), got.slots) == lk.digest(
            lk.kv_buffers(a), slots
        )


def test_swa_pages_restore_their_window_and_a_missing_one_cuts_the_hit(server, engines):
    a, b = engines("swa"), engines("swa")
    tokens = lk.tokens_of(2000, 5)
    src = written(a, tokens, seed=2)
    assert restorable(b, tokens) == [1, 2, 3, 4, 5]
    req, _ = lk.match(b, tokens)
    got = lk.load(b, req)
    assert got.failed == [] and got.tokens == 5 * P
    window = lk.WINDOW // P
    assert lk.digest(lk.kv_buffers(b), got.slots) == lk.digest(lk.kv_buffers(a), src)
    theirs, mine = lk.swa_slots(a, src[-window * P :]), lk.swa_slots(b, got.slots[-window * P :])
    assert lk.digest(lk.swa_buffers(b), mine) == lk.digest(lk.swa_buffers(a), theirs)
    # the SWA page of page 3 goes: endpoints 4 and 5 need it in their window, 1-3 do not
    c = engines("swa")
    server.client().delete(c.linker.names[PoolName.SWA], [kit.hashes(tokens)[3]])
    assert restorable(c, tokens) == [1, 2, 3]
    req, m = lk.match(c, tokens)
    assert m.host_hit_length == 3 * P
    got = lk.load(c, req)
    assert got.failed == [] and got.tokens == 3 * P
    assert lk.digest(lk.kv_buffers(c), got.slots) == lk.digest(lk.kv_buffers(a), src[: 3 * P])
    theirs, mine = lk.swa_slots(a, src[P : 3 * P]), lk.swa_slots(c, got.slots[P:])
    assert lk.digest(lk.swa_buffers(c), mine) == lk.digest(lk.swa_buffers(a), theirs)


@pytest.mark.parametrize("kind,source", [("mamba", "kv-sidecar"), ("mla_mamba", "sglang")])
def test_mamba_states_restore_only_at_node_ends(server, engines, kind, source):
    """Two inserts make nodes ending at pages 2 and 5, each with its state: restorable {2, 5};
    without the state at page 5 the tree takes 2 pages and the first state."""
    a, b = engines(kind), engines(kind)
    assert a.linker.pool_source == source
    tokens = lk.tokens_of(3000, 5)
    short = written(a, tokens[: 2 * P], seed=3)
    written(a, tokens, seed=4)
    states = {2: lk.mamba_slot(a, tokens[: 2 * P]), 5: lk.mamba_slot(a, tokens)}
    assert states[2] != states[5]
    assert restorable(b, tokens) == [2, 5]
    req, m = lk.match(b, tokens)
    got = lk.load(b, req)
    assert got.failed == [] and got.tokens == 5 * P
    assert lk.digest(lk.mamba_buffers(b), [req.kv.mamba_pool_idx]) == lk.digest(
        lk.mamba_buffers(a), [states[5]]
    )
    server.client().delete(b.linker.names[PoolName.MAMBA], [kit.hashes(tokens)[4]])
    c = engines(kind)
    assert restorable(c, tokens) == [2]
    req, m = lk.match(c, tokens)
    got = lk.load(c, req)
    assert got.failed == [] and got.tokens == 2 * P
    assert lk.digest(lk.mamba_buffers(c), [req.kv.mamba_pool_idx]) == lk.digest(
        lk.mamba_buffers(a), [states[2]]
    )
    assert lk.digest(lk.kv_buffers(c), got.slots) == lk.digest(lk.kv_buffers(a), short)


def test_a_page_evicted_between_lookup_and_load_is_reported_not_loaded(server, engines):
    a, b = engines("kv"), engines("kv")
    tokens = lk.tokens_of(4000, 5)
    written(a, tokens, seed=5)
    req, m = lk.match(b, tokens)
    assert m.host_hit_length == 5 * P
    ns = b.linker.names[PoolName.KV]
    got = lk.load(b, req, between=lambda: server.client().delete(ns, [kit.hashes(tokens)[2]]))
    assert got.failed == [req]  # the tree aborts it: never used
    assert (
        req.skip_radix_cache_insert
        and req.discard_output_reason.message == "External KV cache load failed"
    )
    assert b.linker.stats["load_failures"] == 1 and b.linker.stats["pages_loaded"] == 0
    req, m = lk.match(b, tokens)  # the next request: a 2-page hit
    assert m.host_hit_length == 2 * P
    assert lk.load(b, req).failed == []


def test_a_sidecar_that_is_not_there_is_a_miss_and_never_raises(engines, tmp_path):
    eng = engines("kv", url=f"unix://{tmp_path}/none.sock")
    tokens = lk.tokens_of(5000, 3)
    lk.compute(eng, tokens, seed=6)
    eng.cache.check_hicache_events()
    req, m = lk.match(eng, tokens[: 2 * P] + [1] * P)  # the device tree has 2 pages; nothing else
    assert m.host_hit_length == 0
    assert eng.linker.stats["failures"] >= 1


def test_dsa_indexer_and_draft_pools_are_left_to_the_hicache_backend(unpinned):
    """SGLang's assembler gives a DSA model KV + INDEXER pools; a draft model adds its KV pool:
    the linker refuses both at startup (they keep the HiCache backend)."""
    from tests.engines.sglang import assembled

    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        page_size=assembled.DSA_P,
    )
    with pytest.raises(ValueError, match="HiCache backend"):
        device_pool_group(assembled.dsa_pool(2), params, assembled.DSA_P, {ComponentType.FULL})
    kv, draft = lk._pools("kv")[1], lk._pools("kv")[1]
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        page_size=P,
        sidecar_draft_device_pools=(draft,),
    )
    with pytest.raises(ValueError, match="draft"):
        device_pool_group(kv, params, P, {ComponentType.FULL})
    assert (
        device_pool_group(
            kv,
            CacheInitParams(
                disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=P
            ),
            P,
            {ComponentType.FULL},
        )[1]
        == "kv-sidecar"
    )
