"""Hybrid models' parts of the vLLM connector, without vLLM (api/engine/vllm_groups.py):
the group plans, the one `batch/exists` over every group's namespace with its hit rule,
per-group loads and saves (null blocks skipped, Mamba only at a block end), and the
worker's per-request reports. The engine runs are tests/engines/vllm/test_vllm_hybrid.py."""

from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace

import torch

from api.engine.client import SidecarClient
from api.engine.vllm_groups import FAILED, HybridScheduler, HybridWorker, is_hybrid, plan_groups
from api.engine.vllm_layout import PageLayout
from api.engine.vllm_scheduler import Transfer
from api.engine.vllm_worker import WorkerSide
from tests.engines.adapters.test_vllm_connector_parts import BS, N, cpu_caches, hkeys, spec_for


class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


class ChunkedLocalAttentionSpec(SimpleNamespace):
    pass


def config(*specs):
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}"]) for i, s in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups)


FULL_SPEC = FullAttentionSpec(block_size=BS)
SWA_SPEC = SlidingWindowSpec(block_size=BS, sliding_window=48)
MAMBA_SPEC = MambaSpec(block_size=BS, mamba_cache_mode="align")


def test_group_plans():
    plans, why = plan_groups(config(FULL_SPEC, SWA_SPEC, MAMBA_SPEC), tail=False)
    assert why == "" and [(p.kind, p.pool, p.window) for p in plans] == [
        ("full", "kv", 0),
        ("swa", "swa", 2),
        ("mamba", "mamba", 1),
    ]  # 47 tokens: 2 blocks
    plans, _ = plan_groups(config(FULL_SPEC, SWA_SPEC), tail=True)
    assert plans[1].window == 3  # a tail ends mid-block
    assert not is_hybrid(config(FULL_SPEC)) and is_hybrid(config(SWA_SPEC))
    refused = [
        config(FULL_SPEC, MambaSpec(block_size=BS, mamba_cache_mode="none")),
        config(FULL_SPEC, SlidingWindowSpec(block_size=16, sliding_window=48)),
        config(MAMBA_SPEC),
        config(FULL_SPEC, ChunkedLocalAttentionSpec(block_size=BS)),
    ]
    for cfg in refused:
        plans, why = plan_groups(cfg, tail=False)
        assert plans == [] and why


def namespaces(client, pools=("kv", "swa", "mamba"), rank=0):
    names = []
    for pool in pools:
        ns = f"t.{pool}.{rank}"
        client.put_namespace(ns, page_bytes=512, pool=pool, model="tiny")
        names.append(ns)
    return names


def request(rid, n_tokens, hashes):
    return SimpleNamespace(
        request_id=rid,
        num_tokens=n_tokens,
        num_computed_tokens=0,
        block_hashes=hashes,
        all_token_ids=list(range(n_tokens)),
    )


def test_one_exists_gives_the_prefix_every_group_restores(server):
    client = server.client()
    names = namespaces(client)
    hashes = [hashlib.sha256(f"h{i}".encode()).digest() for i in range(6)]
    keys = [h.hex() for h in hashes]
    held = {"kv": range(6), "swa": [0, 1, 2, 4, 5], "mamba": [1, 4]}
    for ns, pool in zip(names, ("kv", "swa", "mamba"), strict=True):
        for i in held[pool]:
            assert client.put_page(ns, keys[i], bytes(512))
    plans, _ = plan_groups(config(FULL_SPEC, SWA_SPEC, MAMBA_SPEC), tail=False)
    s = HybridScheduler(client, BS, lookup_wait=5.0, plans=plans)
    s.ranks = [names]
    s.specs = {ns: {"page_bytes": 512, "model": "tiny"} for ns in names}
    assert s.extra_pools() == [
        {"namespace": names[1], "policy": "trailing_pages", "window": 2},
        {"namespace": names[2], "policy": "trailing_pages", "window": 1},
    ]
    # kv restores 6; swa (window 2, page 3 missing) 0-3 or 6; Mamba (states 1, 4) 2 or 5:
    # 2 is the greatest endpoint all three restore (5 has page 3 in its window)
    req = request("r", 6 * BS + 1, hashes)
    assert s.matched(req, 0) == 2 * BS
    blocks = [[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 0, 0, 0, 0], [0, 31, 32, 0, 0, 0, 0]]
    s.allocated(req, blocks, 2 * BS)
    loads = s.take_loads()
    assert [(t.group, t.keys, t.block_ids) for t in loads] == [
        (0, keys[:2], [10, 11]),
        (1, keys[:2], [20, 21]),
        (2, keys[1:2], [31]),
    ]

    # a step from 2 blocks to 4 saves blocks 2, 3 of every attention group, and the state
    # of block 3 (the step ends on its boundary); the next one, ending mid-block, no state
    req.num_computed_tokens = 2 * BS
    blocks = [[10, 11, 12, 13, 14, 15, 16], [0, 0, 22, 23, 24, 25, 26], [0, 31, 32, 33, 34, 35, 36]]
    saves = s.saves({"r": 2 * BS}, lambda rid: blocks)
    assert [(t.group, t.keys, t.block_ids) for t in saves] == [
        (0, keys[2:4], [12, 13]),
        (1, keys[2:4], [22, 23]),
        (2, keys[3:4], [33]),
    ]
    assert saves[0].tokens is not None and saves[1].tokens is None  # KV events: the anchor's
    req.num_computed_tokens = 4 * BS
    saves = s.saves({"r": BS + 5}, lambda rid: blocks)
    assert [t.group for t in saves] == [0, 1] and saves[0].keys == keys[4:5]

    # its load failed: vLLM computes it from the start; no hit on the retry, all saved again
    s.loads_failed({"r"})
    assert s.matched(req, 0) == 0 and s.tracked["r"].stored == 0
    s.finished(req)
    assert "r" not in s.failed and "r" not in s.tracked
    s.close()


def test_extra_pools_span_every_rank(server):
    plans, _ = plan_groups(config(FULL_SPEC, SWA_SPEC), tail=False)
    s = HybridScheduler(server.client(), BS, plans=plans)
    s.ranks = [["kv0", "swa0"], ["kv1", "swa1"]]
    assert s.extra_pools() == [
        {"namespace": "swa0", "policy": "trailing_pages", "window": 2},
        {"namespace": "kv1", "policy": "all_pages"},
        {"namespace": "swa1", "policy": "trailing_pages", "window": 2},
    ]
    # no full-attention group: the sliding window group anchors, held to all its pages
    plans, _ = plan_groups(config(SWA_SPEC), tail=False)
    s2 = HybridScheduler(server.client(), BS, plans=plans)
    s2.ranks = [["swa0"], ["swa1"]]
    assert s2.extra_pools() == [{"namespace": "swa1", "policy": "all_pages"}]
    s.close()
    s2.close()


def sides(url, caches):
    """Two groups over one cache dict: layer 0 and layer 1, each its namespace."""
    out = []
    for i, pool in enumerate(("kv", "swa")):
        layers = {f"model.layers.{i}.attn": caches[f"model.layers.{i}.attn"]}
        layout = PageLayout.of(layers, N)
        out.append(
            WorkerSide(SidecarClient(url), layout, spec_for(layout, model=f"tiny-{pool}"), 4)
        )
    return out


def test_worker_moves_each_group_and_never_holds_blocks_for_sets(server):
    src, dst = cpu_caches(), cpu_caches(seed=1)
    w1, w2 = (
        HybridWorker(sides(server.socket_url, src)),
        HybridWorker(sides(server.socket_url, dst)),
    )
    keys = hkeys(3)
    # group 1's set is held by an event: the request's blocks are free all the same (the
    # step copied them out), so no save is ever reported to vLLM as holding them
    side = w1.sides[1]
    real, gate, entered = side._set, threading.Event(), threading.Event()

    def held(*args):
        entered.set()
        gate.wait(10)
        return real(*args)

    side._set = held
    w1.save([Transfer("s", keys, [1, 2, 3], group=0), Transfer("s", keys[:2], [4, 5], group=1)])
    assert entered.wait(10)
    w1.sides[0].drain()
    assert w1.transfer_results({"s"})[0] == set()
    gate.set()
    side.drain()
    assert w1.transfer_results(set())[0] == set()
    assert w1.sides[0].stats["saved"] == 3 and side.stats["saved"] == 2

    # loads land in each group's layers; a page missing in one group fails the request
    w2.load(
        [
            Transfer("a", keys, [7, 8, 9], group=0),
            Transfer("a", keys[:2], [10, 11], group=1),
            Transfer("b", keys[:1], [12], group=0),
            Transfer("b", hkeys(1, "gone"), [13], group=1),
            Transfer("c", [], [], group=FAILED),
        ]
    )
    for d, s_ in ((7, 1), (8, 2), (9, 3)):
        assert torch.equal(dst["model.layers.0.attn"][d], src["model.layers.0.attn"][s_])
    for d, s_ in ((10, 4), (11, 5)):
        assert torch.equal(dst["model.layers.1.attn"][d], src["model.layers.1.attn"][s_])
    assert w2.transfer_results(set()) == (set(), {"a", "b", "c"}, {"b", "c"})
    assert w2.transfer_results(set()) == (set(), set(), set())
    assert all(s.take_load_errors() == set() for s in w2.sides)  # never as block ids
    w1.close()
    w2.close()
