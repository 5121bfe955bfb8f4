"""The kv-sidecar linker across processes: two SGLang engine processes on one sidecar process,
two TP ranks of one engine (a gloo group, SGLang's tree intersecting their answers), and a
sidecar restart with pages back from its file tier (linker_proc.py, loadtest/kit/sglang/linker.py)."""

import json
import os
import subprocess
import sys

from sglang.srt.mem_cache.hicache_storage import PoolName

from api.engine.client import SidecarClient
from loadtest.kit.sglang import linker as lk
from loadtest.kit.sglang import pools as kit  # SGLang's CPU settings before anything imports SGLang
from loadtest.kit.sglang.linker import P
from tests.conftest import ROOT


def engine_procs(*args_list):
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.engines.sglang.linker_proc", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
        for args in args_list
    ]


def answer(proc) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"engine process ended: {proc.wait(60)} {proc.stderr.read()[-3000:]}")
    return json.loads(line)


def test_two_engine_processes_load_each_others_pages(spawn):
    sidecar = spawn("--host-pool", "32MiB", "--no-file-tier").wait_ready()
    procs = engine_procs(
        [sidecar.socket_url, "share", "mamba", "11"], [sidecar.socket_url, "share", "mamba", "12"]
    )
    try:
        wrote = [answer(p) for p in procs]  # both computed and offloaded
        assert [w["offloaded"] for w in wrote] == [7, 7]  # 6 KV pages and the node's state
        for p, other in zip(procs, ("12", "11"), strict=True):
            p.stdin.write(other + "\n")
            p.stdin.flush()
        got = [answer(p) for p in procs]
        for p in procs:
            assert p.wait(120) == 0, p.stderr.read()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [g["hit"] for g in got] == [6 * P, 6 * P] and [g["failed"] for g in got] == [0, 0]
    assert got[0]["loaded"] == wrote[1]["wrote"] and got[1]["loaded"] == wrote[0]["wrote"]
    assert wrote[0]["wrote"]["kv"] != wrote[1]["wrote"]["kv"]


def test_tp_ranks_agree_on_the_shorter_prefix_and_keep_their_own_pages(spawn, tmp_path):
    """MHA: pages per rank; rank 1 lost page 3, so rank 0's own answer (1-5) is cut to the
    ranks' intersection (1-3) by SGLang's tree, and each rank loads its own bytes. MLA: one
    copy, written by rank 0 (rank 1 offloads nothing) and loaded by both."""
    sidecar = spawn("--host-pool", "32MiB", "--no-file-tier").wait_ready()
    init = str(tmp_path / "gloo")
    procs = engine_procs(*[[sidecar.socket_url, "tp", str(rank), init] for rank in (0, 1)])
    try:
        outs = [answer(p) for p in procs]
        for p in procs:
            assert p.wait(120) == 0, p.stderr.read()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    (kv0, mla0), (kv1, mla1) = [(o["kv"], o["mla"]) for o in outs]
    assert kv0["namespace"] != kv1["namespace"] and mla0["namespace"] == mla1["namespace"]
    assert (kv0["own"], kv1["own"]) == ([1, 2, 3, 4, 5], [1, 2, 3])
    assert kv0["hit"] == kv1["hit"] == 3 and kv0["failed"] == kv1["failed"] == 0
    assert kv0["loaded"] == kv0["wrote_prefix"] and kv1["loaded"] == kv1["wrote_prefix"]
    assert kv0["loaded"] != kv1["loaded"]  # each rank's own heads
    assert (mla0["offloaded"], mla1["offloaded"]) == (5, 0)
    assert mla0["own"] == mla1["own"] == [1, 2, 3, 4, 5] and mla0["hit"] == mla1["hit"] == 5
    assert mla0["loaded"] == mla1["loaded"] == mla0["wrote_prefix"] != mla1["wrote_prefix"]


def test_pages_come_back_from_the_file_tier_after_a_sidecar_restart(spawn, tmp_path):
    data = str(tmp_path / "data")
    first = spawn("--host-pool", "32MiB", "--data-dir", data).wait_ready()
    with kit.single_rank(), kit.host_budget():
        a = lk.engine(first.socket_url, "mamba")
        lk.scramble(a, 1)
        tokens = lk.tokens_of(9000, 4)
        req, slots = lk.compute(a, tokens, seed=9)
        lk.settle(a)
        state = lk.mamba_slot(a, tokens)
        assert SidecarClient(first.socket_url).request("POST", "/v1/flush")[1]["pending"] == 0
        assert first.terminate()[0] == 0
        again = spawn("--host-pool", "32MiB", "--data-dir", data, socket=first.socket).wait_ready()
        b = lk.engine(again.socket_url, "mamba")  # a new engine: its namespaces are new
        lk.scramble(b, 2)
        try:
            req, m = lk.match(b, tokens)
            assert m.host_hit_length == 4 * P
            got = lk.load(b, req)
            assert got.failed == [] and got.tokens == 4 * P
            assert lk.digest(lk.kv_buffers(b), got.slots) == lk.digest(lk.kv_buffers(a), slots)
            assert lk.digest(lk.mamba_buffers(b), [req.kv.mamba_pool_idx]) == lk.digest(
                lk.mamba_buffers(a), [state]
            )
            ns = b.linker.names[PoolName.KV]
            assert (
                SidecarClient(again.socket_url).stats()["namespaces"][ns]["pages"].get("file", 0)
                == 4
            )
            # the first engine lost its registration with the old process: a lookup finds its
            # namespace gone and has the offload thread register again; its offloads work
            lk.match(a, tokens[: 2 * P] + lk.tokens_of(50, 2))
            a.linker.offload_queue.join()
            assert set(a.linker.buffers) == {PoolName.KV, PoolName.MAMBA} and not a.linker._stale
            before = a.linker.stats["pages_offloaded"]
            lk.compute(a, lk.tokens_of(60, 2), seed=10)
            lk.settle(a)
            assert a.linker.stats["pages_offloaded"] == before + 3  # 2 KV pages and a state
        finally:
            a.close()
            b.close()
