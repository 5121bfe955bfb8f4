"""KV + DSA indexer through SGLang's own `_DsaStrategy` (DSATokenToKVPool's host pool
declarations: MLATokenToKVPoolHost for KV, DSAIndexerPoolHost for the index keys riding on
the KV indices, one packed MTP draft layer in each) and its HybridCacheController: write-back
then prefetch across two engine processes byte for byte, and a hit that the indexer's pages
gate (the sidecar spec is ALL_PAGES). Replaced, GPU-only: cudaHostRegister (assembled.py)."""

import json
import os
import subprocess
import sys

import pytest

from loadtest.kit.sglang import pools as kit
from loadtest.kit.sglang.pools import PoolHitPolicy, PoolName
from tests.conftest import ROOT
from tests.engines.sglang import assembled as asm

P = asm.DSA_P


@pytest.fixture
def stacks(server, unpinned):
    """Build DSA stacks on `server`; their storage threads are stopped at the end."""
    made = []

    def make(seed: int, **kw):
        stack = asm.dsa_stack(server.socket_url, **kw)
        asm.fill_all(stack, seed)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.cc.detach_storage_backend()


def test_the_assembler_builds_kv_and_indexer_and_both_move_zero_copy(stacks):
    stack = stacks(1, drafts=1)
    entries = {str(e.name): type(e.host_pool).__name__ for e in stack.group.entries}
    assert entries == {"kv": "MLATokenToKVPoolHost", "indexer": "DSAIndexerPoolHost"}
    assert [(str(s.pool_name), str(s.indices_from_pool), s.hit_policy) for s in stack.specs] == [
        ("indexer", "kv", PoolHitPolicy.ALL_PAGES)
    ]
    indexer = stack.group.entry_map[PoolName.INDEXER].host_pool
    assert indexer.layer_num == 3 and indexer.mtp_draft_device_pools  # 2 target + 1 packed draft
    assert (
        stack.group.entry_map[PoolName.KV].host_pool.layer_num == 3
    )  # the draft layer rides in KV too
    assert getattr(indexer, "fd", None) is None  # the memfd is only on its allocator
    backend = stack.cc.storage_backend
    assert all(b.buffer_id for b in backend.bindings.values())  # both registered: zero copy
    spec = backend.client.get_namespace(backend.bindings["indexer"].namespace)["spec"]
    assert spec["replicated"] and spec["page_bytes"] == 3 * P * 132  # MLA: stored once


def test_on_host_pools_registered_fires_once_after_every_pool(stacks, caplog):
    """HybridCacheController calls the hook once, after register_mem_pool_host and every
    register_mem_host_pool_v2; the backend logs how each pool moves."""
    caplog.set_level("INFO", logger="kv_sidecar.sglang")
    stacks(2)
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("kv-sidecar pools:")
    ]
    assert lines == ["kv-sidecar pools: kv (zero copy), indexer (zero copy)"]


def test_two_engine_processes_move_kv_and_indexer_byte_exact(spawn):
    sidecar = spawn("--host-pool", "64MiB", "--no-file-tier").wait_ready()

    def engine(op, seed):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.engines.sglang.assembled_proc",
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

    wrote = engine("write", 21)
    read = engine("read", 22)  # other random contents and other slots before the load
    assert wrote["zero_copy"] == ["indexer", "kv"]
    assert wrote["tokens"] == read["tokens"] == read["hit"] == 4 * P
    assert read["pages"] != wrote["pages"]
    assert read["digests"] == wrote["digests"] and set(read["digests"]) == {"kv", "indexer"}
    assert wrote["failures"] == read["failures"] == 0


# (pool whose page is deleted after the write, page index): the indexer gates the hit as KV does
GATES = {
    "nothing": (None, None),
    "indexer page 2": ("indexer", 2),
    "indexer page 0": ("indexer", 0),
    "kv page 1": ("kv", 1),
}


@pytest.mark.parametrize("case", list(GATES))
def test_the_hit_is_gated_by_the_indexer_pages(stacks, case):
    a, b = stacks(3), stacks(4)
    tokens = list(range(9000 + 1000 * len(case), 9000 + 1000 * len(case) + 4 * P))
    keys = asm.hashes(tokens, P)
    a_idx = a.group.alloc(len(tokens))
    assert asm.write_back(a, a_idx, tokens).completed_tokens == len(tokens)
    pool, page = GATES[case]
    if pool:
        backend = a.cc.storage_backend
        assert backend.client.delete(backend.bindings[pool].namespace, [keys[page]]) == 1
    indexer = (asm.presence(b, "indexer", keys), PoolHitPolicy.ALL_PAGES, 1)
    expected = max(asm.brute_force(asm.presence(b, "kv", keys), [indexer]), default=0)
    assert (
        expected == {"nothing": 4, "indexer page 2": 2, "indexer page 0": 0, "kv page 1": 1}[case]
    )
    b.group.alloc(P)
    got = asm.prefetch(b, tokens)
    assert got.op.storage_hit_count == got.loaded == expected * P  # SGLang's controller == the rule
    for pa, pb in zip(
        asm.pages_of(a_idx, P)[:expected], asm.pages_of(got.host_indices, P), strict=True
    ):
        for name in ("kv", "indexer"):
            host_a, host_b = (s.group.entry_map[PoolName(name)].host_pool for s in (a, b))
            assert kit.page_bytes(host_b, pb) == kit.page_bytes(host_a, pa)
    assert a.cc.storage_backend.failures == b.cc.storage_backend.failures == 0
