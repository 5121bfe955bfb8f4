"""The vLLM connector's engine-side parts against a real sidecar, without vLLM: page layout
and copies, namespaces, the worker's staging memfd, the scheduler's single exists call.
The whole connector inside a real vLLM engine is tests/engines/vllm (`make test-vllm`)."""

import hashlib
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from api.engine.client import SidecarClient
from api.engine.vllm_layout import (
    EngineScope,
    PageLayout,
    block_keys,
    namespace_name,
    namespace_spec,
)
from api.engine.vllm_scheduler import SchedulerSide, Transfer
from api.engine.vllm_worker import WorkerSide
from loadtest.kit.procs import free_port, socket_path
from tests.conftest import ROOT

N, BS = 16, 32


def cpu_caches(layers=2, heads=2, head=32, seed=0):
    """CPU_ATTN's shape: [blocks, kv_heads, block_size, 2 * head_size] per layer."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.attn": torch.randn(N, heads, BS, 2 * head, generator=g)
        for i in range(layers)
    }


def spec_for(layout, **over):
    kw = dict(
        model="tiny",
        dtype="torch.float32/auto",
        block_size=BS,
        backend="CPU_ATTN.vec",
        hashing="sha256/32",
        rank={"tp": 0, "tp_size": 1, "pp": 0, "pp_size": 1, "cp": 0, "cp_size": 1},
    )
    kw.update(over)
    return namespace_spec(EngineScope(**kw), layout)


def hkeys(n, salt="k"):
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


@pytest.mark.parametrize("split", [False, True])
def test_blocks_round_trip_through_staging(split):
    # split: FlashAttention's [2, blocks, block_size, heads, head]: K and V views
    src = (
        {"l0": torch.randn(2, N, BS, 2, 16), "l1": torch.randn(2, N, BS, 2, 16)}
        if split
        else cpu_caches()
    )
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    a, b = PageLayout.of(src, N), PageLayout.of(dst, N)
    assert a.page_bytes == sum(v.numel() * 4 for v in src.values()) // N
    staging = torch.zeros(6, a.page_bytes, dtype=torch.uint8)
    # runs: 3->1 alone, 5->0 alone, then 10, 11, 12 -> 3, 4, 5 in one copy
    a.to_staging(a.staging_views(staging), [3, 5, 10, 11, 12], [1, 0, 3, 4, 5])
    b.from_staging(b.staging_views(staging), [1, 0, 3, 4, 5], [7, 8, 1, 2, 13])
    blk = (lambda t, i: t[:, i]) if split else (lambda t, i: t[i])
    for name in src:
        for d, s_ in ((7, 3), (8, 5), (1, 10), (2, 11), (13, 12)):
            assert torch.equal(blk(dst[name], d), blk(src[name], s_))
        assert not blk(dst[name], 3).any()


def test_unsupported_layout_is_refused():
    with pytest.raises(ValueError, match="unsupported KV cache layout"):
        PageLayout.of({"l0": torch.zeros(BS, N, 4)}, N)


def test_namespaces_are_deterministic_and_separate():
    layout = PageLayout.of(cpu_caches(), N)
    name = namespace_name(spec_for(layout))
    code = (
        "import torch; from tests.engines.adapters.test_vllm_connector_parts import *; "
        "print(namespace_name(spec_for(PageLayout.of(cpu_caches(seed=5), N))))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
        check=True,
    ).stdout.strip()
    assert other == name  # another process, another hash seed, other cache contents
    variants = [
        spec_for(layout, dtype="torch.bfloat16/auto"),
        spec_for(layout, block_size=64),
        spec_for(layout, backend="CPU_ATTN.amx"),
        spec_for(layout, hashing="xxhash/32"),
        spec_for(layout, model="other"),
        spec_for(PageLayout.of(cpu_caches(heads=4), N)),
        spec_for(
            layout, rank={"tp": 1, "tp_size": 2, "pp": 0, "pp_size": 1, "cp": 0, "cp_size": 1}
        ),
    ]
    names = {namespace_name(s) for s in variants}
    assert len(names) == len(variants) and name not in names


def test_block_keys_take_the_hash_ending_each_block():
    hashes = [bytes([i]) * 32 for i in range(7)]
    assert block_keys(hashes, 1, 3) == [bytes([i]).hex() * 32 for i in range(3)]
    assert block_keys(hashes, 2, 10) == [bytes([i]).hex() * 32 for i in (1, 3, 5)]
    with pytest.raises(TypeError):
        block_keys([123], 1, 1)


def worker(url, caches, staging=4):
    layout = PageLayout.of(caches, N)
    spec = spec_for(layout)
    return WorkerSide(SidecarClient(url), layout, spec, staging)


def test_worker_saves_and_loads_by_slot_and_reports(make_server):
    port, sock = free_port(), socket_path()
    srv = make_server(port=port, socket=sock)
    src, dst = cpu_caches(), cpu_caches(seed=1)
    w1, w2 = worker(srv.socket_url, src), worker(srv.socket_url, dst)
    keys = hkeys(6)
    # 6 blocks through 4 staging slots: two rounds, the first set returned before the second
    w1.save([Transfer("r1", keys[:4], [1, 2, 3, 4])])
    w1.drain()
    w1.save([Transfer("r1", keys[4:], [5, 6])])
    w1.drain()
    assert w1.stats["saved"] == 6 and w1.stats["save_skipped"] == 0
    w2.load([Transfer("r2", keys[:5] + hkeys(1, "absent"), [9, 10, 11, 12, 13, 14])])
    assert w2.take_load_errors() == {14} and w2.stats["loaded"] == 5
    for i in range(5):
        for name in src:
            assert torch.equal(dst[name][9 + i], src[name][1 + i])
    assert srv.client().stats()["namespaces"][w1.namespace]["pages"]["host"] == 6

    # the sidecar goes away: loads fail as errors, saves are dropped, nothing raises
    srv.stop()
    w2.load([Transfer("r3", keys[:2], [2, 3])])
    assert w2.take_load_errors() == {2, 3}
    w2.save([Transfer("r4", hkeys(2, "new"), [2, 3])])
    w2.drain()
    assert w2.stats["save_failed"] == 2

    # a new sidecar on the same port: the worker registers namespace and buffer again
    srv = make_server(port=port, socket=sock)
    w2.save([Transfer("r5", hkeys(2, "new"), [2, 3])])
    w2.drain()
    assert srv.client().exists(w2.namespace, hkeys(2, "new")) == 2
    w1.close()
    w2.close()


def test_a_step_never_waits_for_the_sidecar_to_free_staging(server):
    """Saves that find no free staging slot (the sets before still running: the sidecar
    slow, its file tier backed up) are skipped and counted, never waited for; the pages
    saved before are kept, and the next save once the slots are back goes through."""
    src = cpu_caches()
    w = worker(server.socket_url, src, staging=4)
    gate, entered = threading.Event(), threading.Event()
    real = w._set

    def held(*args):
        entered.set()
        gate.wait(30)
        return real(*args)

    w._set = held
    keys = hkeys(7)
    w.save([Transfer("a", keys[:4], [1, 2, 3, 4])])  # takes every slot, its set held
    assert entered.wait(10)
    step = threading.Thread(target=w.save, args=([Transfer("b", keys[4:6], [5, 6])],))
    step.start()
    step.join(5)
    assert not step.is_alive(), "the step waited for the sidecar"
    assert w.stats["save_skipped"] == 2 and not gate.is_set()
    gate.set()
    w.drain()
    w._set = real
    w.save([Transfer("c", keys[6:], [7])])
    w.drain()
    assert w.stats["saved"] == 5 and w.stats["save_skipped"] == 2
    assert server.client().exists(w.namespace, keys[:4]) == 4
    assert server.client().exists(w.namespace, keys[6:]) == 1
    w.close()


def test_a_load_failure_keeps_that_requests_saves_out():
    """Blocks computed on top of a block that did not load are never stored."""
    # nothing listens on the port: the load fails at once
    w = WorkerSide(
        SidecarClient(f"http://127.0.0.1:{free_port()}", timeout=0.5),
        PageLayout.of(cpu_caches(), N),
        {"page_bytes": 1, "model": "m"},
        2,
    )
    w.load([Transfer("r", hkeys(1), [1])])
    assert w.take_load_errors() == {1}
    w.save([Transfer("r", hkeys(1, "after"), [2])])
    assert w.pending == [] and w.stats["save_skipped"] == 0
    w.close()


def request(rid, n_tokens, hashes):
    return SimpleNamespace(
        request_id=rid, num_tokens=n_tokens, num_computed_tokens=0, block_hashes=hashes
    )


def test_scheduler_one_exists_call_late_answer_and_last_token(server):
    client = server.client()
    layout = PageLayout.of(cpu_caches(), N)
    spec = spec_for(layout)
    ns = namespace_name(spec)
    client.put_namespace(ns, **spec)
    hashes = [hashlib.sha256(f"b{i}".encode()).digest() for i in range(4)]
    w = worker(server.socket_url, cpu_caches())
    w.save([Transfer("w", [h.hex() for h in hashes], [0, 1, 2, 3])])
    w.drain()
    s = SchedulerSide(client, BS, lookup_wait=0.5)
    s.specs = {ns: spec}

    # the exists call is late (the lookup thread is held by an event): None, then the answer
    gate, held = threading.Event(), threading.Event()
    s.pool.submit(lambda: (held.set(), gate.wait(10)))
    held.wait(5)
    s.lookup_wait = 0.0
    req = request("r", 4 * BS, hashes)  # 4 full blocks, but the last token is never claimed
    assert s.matched(req, 0) is None
    gate.set()
    s.lookup_wait = 5.0
    assert s.matched(req, 0) == 3 * BS
    assert s.matched(req, 2 * BS) == BS  # beyond what vLLM's own cache holds
    s.allocated(req, [10, 11, 12, 13, 14], 3 * BS - 2 * BS)
    (load,) = s.take_loads()
    assert load.block_ids == [12] and load.keys == [hashes[2].hex()]

    # saves: only full computed blocks past what the sidecar holds, each once
    req.num_computed_tokens = 2 * BS
    assert s.saves({"r": BS}, lambda rid: [10, 11, 12, 13, 14]) == []
    req.num_tokens = 5 * BS + 3
    req.block_hashes = hashes + [hashlib.sha256(b"b4").digest()]
    (save,) = s.saves({"r": 3 * BS}, lambda rid: [10, 11, 12, 13, 14])
    assert save.block_ids == [13, 14] and len(save.keys) == 2
    assert s.saves({"r": 3 * BS}, lambda rid: [10, 11, 12, 13, 14]) == []
    # block 12 did not load: vLLM recomputes from it, and it is saved again with what follows
    s.load_failed({12}, lambda rid: [10, 11, 12, 13, 14])
    req.num_computed_tokens = 2 * BS
    (again,) = s.saves({"r": 3 * BS}, lambda rid: [10, 11, 12, 13, 14])
    assert again.block_ids == [12, 13, 14] and again.keys[0] == hashes[2].hex()
    s.finished(req)
    assert "r" not in s.tracked and "r" not in s.lookups
    w.close()
    s.close()


def test_scheduler_registers_again_after_a_restart(server):
    client = server.client()
    layout = PageLayout.of(cpu_caches(), N)
    spec = spec_for(layout)
    ns = namespace_name(spec)
    s = SchedulerSide(client, BS, lookup_wait=5.0)
    s.specs = {ns: spec}  # the namespace does not exist on this sidecar (yet)
    hashes = [hashlib.sha256(f"z{i}".encode()).digest() for i in range(3)]
    assert s.matched(request("q", 3 * BS + 1, hashes), 0) == 0
    assert client.get_namespace(ns)["spec"]["page_bytes"] == layout.page_bytes
    s.close()


def test_a_late_answer_is_waited_for_up_to_a_share_of_a_step(monkeypatch):
    """Answering None costs a request a whole step, waiting costs the batch the wait: the
    scheduler waits for a late exists answer up to 5% of the steps' mean length (at least
    `lookup_wait`, never past `lookup_timeout`); an idle gap between steps is no step."""
    from api.engine import vllm_scheduler as vs

    clock = [100.0]
    monkeypatch.setattr(vs.time, "monotonic", lambda: clock[0])
    s = SchedulerSide(SidecarClient("http://127.0.0.1:1"), BS, lookup_wait=0.002)
    assert s.wait_s() == pytest.approx(0.05)  # no step timed yet: one of 1 s assumed
    for step in (2.0, 2.0, 2.0):
        s.take_loads()
        clock[0] += step
    s.take_loads()
    assert s.step_s == pytest.approx(2.0) and s.wait_s() == pytest.approx(0.1)
    clock[0] += 600.0  # idle for ten minutes: counted as twice the mean at most
    s.take_loads()
    assert s.step_s == pytest.approx(0.8 * 2.0 + 0.2 * 4.0)
    s.step_s = 1000.0
    assert s.wait_s() == s.lookup_timeout
    s.close()


def test_the_wait_covers_the_step_a_long_prompt_would_join(monkeypatch):
    """Short decode steps make a short mean: a 1,756-token prompt arriving among them once
    lost a 9.6 s prefill step to a 6 ms answer (wait 2 ms). The wait is also a share of
    the request's own uncomputed tokens (at most a step's budget) at the steps' seconds a
    token; an idle gap counts at most twice the mean rate."""
    from api.engine import vllm_scheduler as vs

    clock = [100.0]
    monkeypatch.setattr(vs.time, "monotonic", lambda: clock[0])
    s = SchedulerSide(SidecarClient("http://127.0.0.1:1"), BS, lookup_wait=0.002)
    for _ in range(4):  # decode steps: 8 tokens in 40 ms
        s.take_loads(8)
        clock[0] += 0.04
    s.take_loads(8)
    assert s.step_s == pytest.approx(0.04) and s.token_s == pytest.approx(0.005)
    assert s.wait_s() == pytest.approx(0.002)  # 5% of 40 ms: the floor
    assert s.wait_s(1756) == pytest.approx(0.05 * 1756 * 0.005)  # 439 ms
    s.step_tokens = 1024
    assert s.wait_s(1756) == pytest.approx(0.05 * 1024 * 0.005)  # a step's budget at most
    assert s.wait_s(10**6) == pytest.approx(0.256)
    clock[0] += 600.0  # idle for ten minutes
    s.take_loads(0)
    assert s.token_s == pytest.approx(0.8 * 0.005 + 0.2 * 0.01)  # capped at twice the mean
    clock[0] += 5.0
    s.take_loads(8)
    assert s.token_s == pytest.approx(0.006)  # a step of no tokens times no rate
    s.close()


def test_a_late_answer_within_the_share_is_a_hit_not_a_skipped_step():
    """The scheduler asks with the exists answer still out (its thread held by an event
    that opens well within the wait): with steps of 100 s it waits up to 5 s and gets the
    hit, where it once answered None and the request lost a whole step."""
    gate = threading.Event()

    def exists(ns, keys):
        assert gate.wait(30)
        return len(keys)

    client = SimpleNamespace(exists=exists)
    s = SchedulerSide(client, BS, lookup_wait=0.0, lookup_timeout=10.0)
    s.specs = {"ns": {}}
    s.step_s = 100.0
    hashes = [hashlib.sha256(f"late{i}".encode()).digest() for i in range(4)]
    req = request("r", 4 * BS, hashes)
    opener = threading.Timer(0.2, gate.set)  # opens while `matched` waits (5 s at most)
    opener.start()
    assert s.matched(req, 0) == 3 * BS and s.stats["late"] == 0  # never the last token
    opener.join()
    s.close()


def test_an_old_partial_answer_is_asked_again_when_the_request_is_matched(caplog):
    """A request waits in the queue after its arrival's lookup; the turn before it stores
    its pages meanwhile. Matched later than `lookup_refresh` after that answer, and not a
    whole hit, it is asked again: the grown prefix loads. A whole hit is not asked again;
    a late refresh falls back to the answer it replaces (never 'ask me again')."""
    stored, calls, gate = [1], [], threading.Event()
    gate.set()

    def exists(ns, keys):
        calls.append(len(keys))
        assert gate.wait(30)
        return min(stored[0], len(keys))

    s = SchedulerSide(SimpleNamespace(exists=exists), BS, lookup_wait=0.0, lookup_refresh=0.0)
    s.specs = {"ns": {}}
    hashes = [hashlib.sha256(f"fresh{i}".encode()).digest() for i in range(4)]
    req = request("r", 4 * BS + 1, hashes)
    s.prefetch(req)
    s.lookups["r"].future.result(timeout=30)  # answered on arrival: 1 block
    stored[0] = 3  # the turn before stored two more
    assert s.matched(req, 0) == 3 * BS and s.stats["refreshed"] == 1 and len(calls) == 2
    stored[0] = 4
    gate.clear()  # the next refresh is late
    assert s.matched(req, 0) == 3 * BS and s.stats["late"] == 0  # the answer before it
    assert "a miss" not in caplog.text
    assert s.stats["refreshed"] == 2
    gate.set()
    s.lookups["r"].future.result(timeout=30)  # the late refresh: all 4
    assert s.matched(req, 0) == 4 * BS and s.stats["refreshed"] == 2  # a whole hit: kept
    s.lookup_refresh, stored[0] = 60.0, 1
    other = request("o", 4 * BS + 1, hashes[:1] + [b"x" * 32] * 3)
    s.prefetch(other)
    s.lookups["o"].future.result(timeout=30)
    assert s.matched(other, 0) == BS and s.stats["refreshed"] == 2  # fresh: not asked again
    s.close()
