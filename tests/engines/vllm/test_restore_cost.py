"""Never slower than recomputing (issue 44), with a real vLLM CPU engine: a prefix on a
slowed file tier (every page read 250 ms, `slow_tier`) is recomputed once the engine
has measured both its prefill and that tier, the skip is counted by the sidecar, and a
prefix in the host pool still loads.

    engine 1: P1, P2 computed and saved; flushed to the file tier
    sidecar restarts on its data dir: both prefixes on the (slow) file tier only
    engine 2: Q, Q2 (misses: the second's prefill is timed, the first pays the engine's
              one-time costs), P1 (the tier is unmeasured: loads, slowly,
              and is timed), P2 (judged slower than its prefill: recomputed, counted),
              P1 again (promoted into the host pool by its load: restored)
"""

from __future__ import annotations

import random

from api.engine.client import SidecarClient
from loadtest.kit.procs import SlowTierSidecar, free_port, socket_path

TOKEN = "vllm-test-token"
DELAY_MS = 250


def prompt(seed: int, n: int = 200) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(2, 1024) for _ in range(n)]  # 6 full blocks + 8 tokens


def test_a_slow_tier_is_recomputed_and_counted(spawn, engines, tiny_model, tmp_path):
    data = str(tmp_path / "sidecar-data")
    args = ("--data-dir", data, "--host-pool", "64MiB", "--token", TOKEN, "--log-level", "warning")
    port, sock = free_port(), socket_path()
    sidecar = spawn(*args, port=port, socket=sock).wait_ready(TOKEN)
    p1, p2, q, q2 = prompt(1), prompt(2), prompt(3), prompt(4)
    e1 = engines(tiny_model, sidecar.socket_url, TOKEN)
    ref = e1.ask(op="generate", prompts=[p1, p2])
    assert ref["cached"] == [0, 0]
    assert e1.close() == 0
    c = SidecarClient(sidecar.url, token=TOKEN)
    assert c.request("POST", "/v1/flush")[1]["failed"] == 0
    assert sidecar.terminate()[0] == 0

    slow = SlowTierSidecar(*args, delay_ms=DELAY_MS, port=port, socket=sock).wait_ready(TOKEN)
    try:
        e2 = engines(tiny_model, slow.socket_url, TOKEN, ENGINE_RESTORE_COST="1")
        for fresh in (q, q2):  # misses: their prefill is timed (the engine's first is not)
            assert e2.ask(op="generate", prompts=[fresh], reset=True)["cached"] == [0]
        got = e2.ask(op="generate", prompts=[p1], reset=True)  # unmeasured tier: optimistic
        assert got["cached"] == [len(p1) - 1] and got["tokens"] == ref["tokens"][:1]
        got = e2.ask(op="generate", prompts=[p2], reset=True)  # 7 pages x 250 ms: recomputed
        assert got["cached"] == [0] and got["tokens"] == ref["tokens"][1:]
        got = e2.ask(op="generate", prompts=[p1], reset=True)  # now in the host pool: restored
        assert got["cached"] == [len(p1) - 1] and got["tokens"] == ref["tokens"][:1]
        assert e2.close() == 0
        counters = [
            ns
            for ns in SidecarClient(slow.url, token=TOKEN).stats()["namespaces"].values()
            if ns["restores_skipped"]
        ]
        assert len(counters) == 1 and counters[0]["restores_skipped"] == 1
        assert counters[0]["restore_pages_skipped"] == 7  # 6 full blocks and the tail
        assert "kv_sidecar_restores_skipped_total" in SidecarClient(slow.url, token=TOKEN).metrics()
    finally:
        slow.kill()
