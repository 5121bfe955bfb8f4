"""The scheduler side of the connector with the last block (issue 33), against a real
sidecar, without an engine: which keys a request asks for, what it loads and what it saves.
The same paths inside a real vLLM engine are test_last_block.py."""

import hashlib
import threading
from types import SimpleNamespace

import pytest
import torch

from api.engine.client import SidecarClient
from api.engine.vllm_layout import EngineScope, PageLayout, namespace_name, namespace_spec
from api.engine.vllm_scheduler import SchedulerSide, Transfer
from api.engine.vllm_worker import WorkerSide

BS, N = 32, 16


def tail_key(request, full):
    """Stands for the connector's vLLM-hash tail key: any deterministic name will do here."""
    digest = hashlib.sha256(
        repr((request.block_hashes[:full], request.all_token_ids[full * BS :])).encode()
    )
    return digest.hexdigest() + "-tail"


def request(rid, tokens):
    """A vLLM-like request: chained block hashes of its full blocks."""
    hashes, prev = [], b""
    for i in range(len(tokens) // BS):
        prev = hashlib.sha256(prev + repr(tokens[i * BS : (i + 1) * BS]).encode()).digest()
        hashes.append(prev)
    return SimpleNamespace(
        request_id=rid,
        num_tokens=len(tokens),
        num_computed_tokens=0,
        block_hashes=hashes,
        all_token_ids=list(tokens),
    )


@pytest.fixture
def setup(server):
    caches = {"l0": torch.randn(N, 2, BS, 64)}
    layout = PageLayout.of(caches, N)
    rank = {"tp": 0, "tp_size": 1, "pp": 0, "pp_size": 1, "cp": 0, "cp_size": 1}
    spec = namespace_spec(EngineScope("m", "f32", BS, "CPU_ATTN", "sha256/32", rank), layout)
    ns = namespace_name(spec)
    client = server.client()
    client.put_namespace(ns, **spec)
    w = WorkerSide(SidecarClient(server.socket_url), layout, spec, 8)
    s = SchedulerSide(client, BS, lookup_wait=5.0, tail_key=tail_key)
    s.specs = {ns: spec}
    yield s, w, client, ns
    w.close()
    s.close()


def store(w, keys):
    w.save([Transfer("w", keys, list(range(len(keys))))])
    w.drain()


def test_keys_name_the_block_of_the_last_token(setup):
    s, *_ = setup
    toks = list(range(2, 2 + 4 * BS + 7))
    keys, tail = s.keys_of(request("a", toks))  # 4 full blocks + 7 tokens
    assert len(keys) == 5 and tail and keys[-1].endswith("-tail")
    keys, tail = s.keys_of(request("b", toks[: 4 * BS]))  # on a block boundary: its key
    assert len(keys) == 4 and not tail
    keys, tail = s.keys_of(request("c", toks[: 3 * BS + 1]))  # a 1-token tail loads nothing
    assert len(keys) == 3 and not tail
    legacy = SchedulerSide(s.client, BS)  # no tail_key: the old rule
    legacy.specs = s.specs
    assert len(legacy.keys_of(request("d", toks[: 4 * BS]))[0]) == 3
    legacy.close()


def test_a_restore_gives_every_token_but_the_last(setup):
    s, w, client, ns = setup
    toks = list(range(5, 5 + 3 * BS + 9))
    req = request("r", toks)
    keys, _ = s.keys_of(req)
    store(w, keys)
    s.prefetch(req)  # asked on arrival
    assert s.matched(req, 0) == len(toks) - 1 and s.stats["lookups"] == 1
    s.allocated(req, [7, 8, 9, 10], len(toks) - 1)
    (load,) = s.take_loads()
    assert load.keys == keys and load.block_ids == [7, 8, 9, 10]
    # nothing is saved: every block, the tail too, is the sidecar's already
    req.num_computed_tokens = len(toks) - 1
    assert s.saves({"r": 1}, lambda rid: [7, 8, 9, 10]) == []
    s.finished(req)
    assert "r" not in s.tracked and "r" not in s.hits


def test_an_engine_hit_loads_only_the_last_block(setup):
    s, w, client, ns = setup
    toks = list(range(9, 9 + 4 * BS))
    req = request("h", toks)
    keys, _ = s.keys_of(req)
    store(w, keys)
    local = 3 * BS  # vLLM's own cache: never the last token
    assert s.matched(req, local) == BS - 1
    s.allocated(req, [1, 2, 3, 4], BS - 1)
    (load,) = s.take_loads()
    assert load.keys == keys[3:] and load.block_ids == [4]


def test_the_tail_is_saved_once_the_prompt_is_computed(setup):
    s, w, client, ns = setup
    toks = list(range(11, 11 + 2 * BS + 20))
    req = request("t", toks)
    keys, _ = s.keys_of(req)
    assert s.matched(req, 0) == 0  # nothing stored yet
    s.allocated(req, [3, 4, 5], 0)
    assert s.take_loads() == []
    (first,) = s.saves({"t": BS + 5}, lambda rid: [3, 4, 5])  # chunked prefill: 1 full block so far
    assert first.keys == keys[:1] and first.block_ids == [3]
    assert first.parent is None and first.tokens == [toks[:BS]]  # for KV events
    req.num_computed_tokens = BS + 5
    (second,) = s.saves({"t": len(toks) - BS - 5}, lambda rid: [3, 4, 5])
    assert second.keys == keys[1:] and second.block_ids == [4, 5]  # block 1, then the tail
    assert second.parent == keys[0] and second.tokens == [toks[BS : 2 * BS], toks[2 * BS :]]
    req.num_computed_tokens = len(toks)
    assert s.saves({"t": 1}, lambda rid: [3, 4, 5]) == []  # decoding: saved once
    # the tail's block failed to load somewhere: it is saved again
    s.load_failed({5}, lambda rid: [3, 4, 5])
    (again,) = s.saves({"t": 1}, lambda rid: [3, 4, 5])
    assert again.keys == [keys[-1]] and again.block_ids == [5]
    s.finished(req)
    assert "t" not in s.tracked


def test_a_tail_of_another_prompt_is_no_hit(setup):
    s, w, client, ns = setup
    toks = list(range(20, 20 + 2 * BS + 10))
    keys, _ = s.keys_of(request("x", toks))
    store(w, keys)
    longer = request("y", toks + [7] * 6)  # same full blocks, longer tail
    assert s.matched(longer, 0) == 2 * BS
    shorter = request("z", toks[:-3])
    assert s.matched(shorter, 0) == 2 * BS


def test_unanswered_lookup_counts_vllms_own_blocks_as_stored(setup):
    """vLLM's cache holds what could load: no wait for the answer, and no save of blocks
    this engine computed (and saved) or loaded before."""
    s, w, client, ns = setup
    toks = list(range(30, 30 + 3 * BS + 1))  # 1-token tail: nothing past vLLM's own
    req = request("u", toks)
    gate, held = threading.Event(), threading.Event()
    s.pool.submit(lambda: (held.set(), gate.wait(10)))
    held.wait(5)
    s.prefetch(req)
    assert s.matched(req, 3 * BS) == 0  # answered at once, the lookup still queued
    s.allocated(req, [1, 2, 3, 4], 0)
    req.num_computed_tokens = 3 * BS
    assert s.saves({"u": 1}, lambda rid: [1, 2, 3, 4]) == []
    gate.set()


def test_a_late_answer_asks_again(setup):
    s, w, client, ns = setup
    toks = list(range(40, 40 + 2 * BS + 5))
    req = request("l", toks)
    store(w, s.keys_of(req)[0])
    gate, held = threading.Event(), threading.Event()
    s.pool.submit(lambda: (held.set(), gate.wait(10)))
    held.wait(5)
    s.lookup_wait = 0.0
    assert s.matched(req, 0) is None and s.stats["late"] == 1
    gate.set()
    s.lookup_wait = 5.0
    assert s.matched(req, 0) == len(toks) - 1 and s.stats["lookups"] == 1


def test_saves_carry_parent_and_tokens_in_bounded_sets(setup, monkeypatch):
    """Each set of a save names the key before its first and its keys' tokens (KV events),
    and a long save is cut so one set's tokens stay under the JSON value cap."""
    import api.engine.vllm_worker as vw

    s, w, client, ns = setup
    sent = []
    real = w.client.set
    monkeypatch.setattr(w.client, "set", lambda *a, **kw: (sent.append(kw), real(*a, **kw))[1])
    monkeypatch.setattr(vw, "MAX_SET_TOKENS", 2 * BS)  # two blocks a set
    keys = [f"{i:064x}" for i in range(5)]
    toks = [[i] * BS for i in range(5)]
    w.save([Transfer("m", keys, [0, 1, 2, 3, 4], parent="p" * 64, tokens=toks)])
    w.drain()
    assert [kw.get("parent") for kw in sent] == ["p" * 64, keys[1], keys[3]]
    assert [kw["tokens"] for kw in sent] == [toks[:2], toks[2:4], toks[4:]]
    assert client.exists(ns, keys) == 5
