"""The block holding a prompt's last token, stored and loaded by a real vLLM CPU engine
through a real sidecar (issue 33): a restore hands vLLM every token but the last.

    engine 1 computes each prompt (and saves it), then hits it in its own prefix cache:
             vLLM gives whole blocks, the connector loads the last block
    engine 2 (a new process, its prefix cache emptied) restores each prompt: the full blocks
             and the tail under keys every process names alike; the same greedy tokens
    a prompt that continues another's tail past it is no hit on that tail
"""

from __future__ import annotations

import random

from api.engine.client import SidecarClient

BLOCK = 32
TOKEN = "vllm-last-block"
LENGTHS = {
    "aligned": 4 * BLOCK,
    "tail": 3 * BLOCK + 14,
    "one_token_tail": 3 * BLOCK + 1,
    "short": 20,
}


def prompts() -> dict[str, list[int]]:
    r = random.Random(33)
    return {name: [r.randrange(2, 1024) for _ in range(n)] for name, n in LENGTHS.items()}


def hits(url: str) -> int:
    return sum(ns["hits"] for ns in SidecarClient(url, token=TOKEN).stats()["namespaces"].values())


def test_the_last_block_is_stored_and_loaded(spawn, engines, tiny_model, tmp_path):
    sidecar = spawn(
        "--no-file-tier", "--host-pool", "64MiB", "--token", TOKEN, "--log-level", "warning"
    ).wait_ready(TOKEN)
    ps = prompts()
    e1 = engines(tiny_model, sidecar.socket_url, TOKEN)
    ref = {}
    for name, p in ps.items():
        cold = e1.ask(op="generate", prompts=[p], max_tokens=6)
        assert cold["cached"] == [0]
        ref[name] = cold["tokens"]
        before = hits(sidecar.url)
        hit = e1.ask(
            op="generate", prompts=[p], max_tokens=6
        )  # vLLM's own blocks + the sidecar's last
        assert hit["tokens"] == ref[name]
        assert hit["cached"] == [len(p) - 1], name
        own = (len(p) - 1) // BLOCK
        assert hits(sidecar.url) - before == -(-(len(p) - 1) // BLOCK) - own, name
    e1.ask(op="generate", prompts=[ps["tail"]], max_tokens=1, reset=True)  # waits for the saves
    assert e1.close() == 0

    e2 = engines(tiny_model, sidecar.socket_url, TOKEN)
    for name, p in ps.items():
        before = hits(sidecar.url)
        got = e2.ask(op="generate", prompts=[p], max_tokens=6, reset=True)
        assert got["tokens"] == ref[name], name
        assert got["cached"] == [len(p) - 1], name  # every token but the last, from the sidecar
        assert hits(sidecar.url) - before == -(-(len(p) - 1) // BLOCK), name

    # the tail prompt, continued past its tail: its full blocks hit, the old tail does not
    longer = ps["tail"] + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    got = e2.ask(op="generate", prompts=[longer], max_tokens=6, reset=True)
    assert got["cached"] == [3 * BLOCK]
    ref_longer = e2.ask(op="generate", prompts=[longer], max_tokens=6, reset=True)
    assert ref_longer["cached"] == [len(longer) - 1]  # its own tail was saved by the run before
    assert ref_longer["tokens"] == got["tokens"]
    assert e2.close() == 0
