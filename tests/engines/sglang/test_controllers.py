"""SGLang's own HiCacheController and HybridCacheController, built with
storage_backend="dynamic" and our extra config, load the backend through SGLang's factory and
move pages the way SGLang's scheduler does: write-back to storage (backup thread), prefetch
from storage (hit query, host buffers, I/O thread, acks), the v2 hybrid path for KV + Mamba.
Engine A writes, engine B (other pools, other slots) reads: byte-exact."""

import json
import os
import subprocess
import sys

import pytest
import torch

from loadtest.kit.sglang import pools as kit
from tests.conftest import ROOT

TOKENS = list(range(1000, 1016))  # 4 pages


def pages_of(host_indices):
    return [int(i) // kit.P for i in host_indices[:: kit.P]]


class Engines:
    """Controllers built by a test, detached (their storage threads stopped) at the end."""

    def __init__(self):
        self.controllers = []

    def add(self, cc):
        self.controllers.append(cc)
        return cc

    def close(self):
        for cc in self.controllers:
            cc.detach_storage_backend()


@pytest.fixture
def engines():
    e = Engines()
    yield e
    e.close()


# (pools, extra config, the controller's page function): "allocator": "shm", zero copy over
# SGLang's memfd pools; without it, SGLang's private pools through the inline endpoints (the
# loads the dtype fix repaired); SGLang's generic flat-page path (interface_v1 0).
CASES = {
    "zero_copy-page_first": (lambda: kit.mha("page_first"), {}, "_page_get_zero_copy"),
    "zero_copy-layer_first-mla": (lambda: kit.mla("layer_first"), {}, "_page_get_zero_copy"),
    "inline-page_first": (
        lambda: kit.mha("page_first", allocator=""),
        {"allocator": ""},
        "_page_get_zero_copy",
    ),
    "inline-page_first_direct-fp16": (
        lambda: kit.mha("page_first_direct", torch.float16, ""),
        {"allocator": ""},
        "_page_get_zero_copy",
    ),
    "inline-layer_first": (
        lambda: kit.mha("layer_first", allocator=""),
        {"allocator": ""},
        "_page_get_zero_copy",
    ),
    "inline-page_first-mla": (
        lambda: kit.mla("page_first", allocator=""),
        {"allocator": ""},
        "_page_get_zero_copy",
    ),
    "generic-page_first": (
        lambda: kit.mha("page_first", allocator=""),
        {"allocator": "", "interface_v1": 0},
        "_generic_page_get",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hicache_controller_write_back_then_prefetch(server, engines, case):
    build, extra, get_func = CASES[case]
    (a_dev, a_host), (b_dev, b_host) = build(), build()
    kit.randomize(a_host, seed=3)
    kit.randomize(b_host, seed=4)
    a = engines.add(kit.hicache_controller(server.socket_url, a_dev, a_host, **extra))
    b = engines.add(kit.hicache_controller(server.socket_url, b_dev, b_host, **extra))
    assert type(a.storage_backend).__name__ == "SidecarHiCacheStorage"
    assert a.page_get_func.__name__ == get_func
    a_idx = a_host.alloc(len(TOKENS))
    assert kit.write_back(a, a_idx, TOKENS).completed_tokens == len(TOKENS)
    b.mem_pool_host.alloc(3 * kit.P)  # B's prefetch lands in other slots
    b_idx, loaded, _ = kit.prefetch(b, TOKENS)
    assert loaded == len(TOKENS)
    assert pages_of(b_idx) != pages_of(a_idx)
    for pa, pb in zip(pages_of(a_idx), pages_of(b_idx), strict=True):
        assert kit.page_bytes(b_host, pb) == kit.page_bytes(a_host, pa)
    assert kit.prefetch(b, list(range(5000, 5008)))[1] == 0  # never written: no hit
    assert a.storage_backend.failures == b.storage_backend.failures == 0
    server.invariants()


def test_hybrid_controller_kv_and_mamba(server, engines):
    """The v2 path: KV pages zero copy, the Mamba state (trailing page) inline, SGLang's hit rule."""
    (a_kv, a_state), (b_kv, b_state) = (kit.mha(), kit.mamba()), (kit.mha(), kit.mamba())
    for seed, pool in enumerate((a_kv[1], a_state[1], b_kv[1], b_state[1])):
        kit.randomize(pool, seed)
    a = engines.add(kit.hybrid_controller(server.socket_url, a_kv, {kit.PoolName.MAMBA: a_state}))
    b = engines.add(kit.hybrid_controller(server.socket_url, b_kv, {kit.PoolName.MAMBA: b_state}))
    assert sorted(a.storage_backend.bindings) == ["kv", "mamba"]  # registered through v2
    a_idx, slot = a_kv[1].alloc(len(TOKENS)), a_state[1].alloc(1)
    done = kit.write_back(a, a_idx, TOKENS, [kit.mamba_trailing(slot, kit.hashes(TOKENS)[-1])])
    assert done.completed_tokens == len(TOKENS)
    assert done.pool_storage_result.extra_pool_hit_pages == {"mamba": 1}
    b_state[1].alloc(2)
    probe = kit.mamba_trailing()
    b_idx, loaded, hits = kit.prefetch(b, TOKENS, [probe])
    assert loaded == len(TOKENS) and hits["mamba"] == 1
    for pa, pb in zip(pages_of(a_idx), pages_of(b_idx), strict=True):
        assert kit.page_bytes(b_kv[1], pb) == kit.page_bytes(a_kv[1], pa)
    assert int(probe.host_indices[0]) != int(slot[0])
    assert kit.page_bytes(b_state[1], int(probe.host_indices[0])) == kit.page_bytes(
        a_state[1], int(slot[0])
    )
    # the hit rule: 3 pages of KV are stored, but the Mamba state only at page 4: nothing to
    # restore from; 4 stored pages + 1 unknown: the state at page 4 is the endpoint
    assert kit.prefetch(b, TOKENS[:12], [kit.mamba_trailing()])[1] == 0
    assert kit.prefetch(b, TOKENS + [7, 7, 7, 7], [kit.mamba_trailing()])[1] == len(TOKENS)
    assert a.storage_backend.failures == b.storage_backend.failures == 0
    server.invariants()


def test_hybrid_controller_kv_and_swa_window(server, engines):
    """SGLang's SWAKVPool: full-attention KV and the sliding window's last 2 pages, both
    zero copy (each host pool in its own memfd), the window as a trailing_pages pool."""
    (a_kv, a_swa), (b_kv, b_swa) = kit.swa(), kit.swa()
    for seed, pool in enumerate((a_kv[1], a_swa[1], b_kv[1], b_swa[1])):
        kit.randomize(pool, seed + 10)
    a = engines.add(kit.hybrid_controller(server.socket_url, a_kv, {kit.PoolName.SWA: a_swa}))
    b = engines.add(kit.hybrid_controller(server.socket_url, b_kv, {kit.PoolName.SWA: b_swa}))
    assert all(binding.buffer_id for binding in a.storage_backend.bindings.values())
    keys = kit.hashes(TOKENS)
    a_idx, a_win = a_kv[1].alloc(len(TOKENS)), a_swa[1].alloc(2 * kit.P)
    done = kit.write_back(a, a_idx, TOKENS, [kit.swa_trailing(a_win, keys[-2:])])
    assert done.completed_tokens == len(
        TOKENS
    ) and done.pool_storage_result.extra_pool_hit_pages == {"swa": 2}
    b_swa[1].alloc(kit.P)
    probe = kit.swa_trailing()
    b_idx, loaded, hits = kit.prefetch(b, TOKENS, [probe])
    assert loaded == len(TOKENS) and hits["swa"] == 2
    for (host_a, idx_a), (host_b, idx_b) in [
        ((a_kv[1], a_idx), (b_kv[1], b_idx)),
        ((a_swa[1], a_win), (b_swa[1], probe.host_indices)),
    ]:
        for pa, pb in zip(pages_of(idx_a), pages_of(idx_b), strict=True):
            assert kit.page_bytes(host_b, pb) == kit.page_bytes(host_a, pa)
    assert pages_of(probe.host_indices) != pages_of(a_win)
    # endpoint 3 needs the window's pages 2 and 3; only 3 and 4 are stored: no hit
    assert kit.prefetch(b, TOKENS[:12], [kit.swa_trailing()])[1] == 0
    server.invariants()


def test_two_engine_processes_share_one_sidecar(spawn):
    """Two SGLang engine processes, each with its HybridCacheController, one sidecar process."""
    sidecar = spawn("--host-pool", "32MiB", "--no-file-tier").wait_ready()

    def engine(op, seed):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.engines.sglang.engine_proc",
                sidecar.socket_url,
                op,
                str(seed),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    wrote = engine("write", 11)
    read = engine("read", 12)  # other random contents before the load
    assert wrote["zero_copy"] and wrote["tokens"] == read["tokens"] == 16
    assert read["kv"] == wrote["kv"] and read["mamba"] == wrote["mamba"] and read["mamba_hits"] == 1
