"""Never slower than recomputing (issue 44), engine level: TTFT with the stored prefixes on
a file tier slowed on purpose (every page read `--delay-ms` late, tests/engines/vllm/
slow_tier.py) against the engine alone, same prompts, the arms in turn each round (a request
right after the other engine computed runs slower: its OpenMP threads still spin).

    .venv-vllm/bin/python -m loadtest.engines.slow_tier [--prompts 100] [--delay-ms 40]

    writer engine: computes every prompt, the sidecar flushes them to its file tier
    sidecar restarts on its data dir with slow reads: the prefixes are on the slow tier only
    arms: none (no connector) | rule (the connector, restore cost on) | no-rule (off)
    each arm: 6 warm-up requests dropped (3 fresh prompts: the rule times their prefill, the
    engine's first excepted; 3 stored: the rule learns the slow tier); every round has
    prompts of its own (a load promotes its pages into the host pool)

Prints one JSON line per arm (TTFT p50/p90/p99, ms, all rounds) and the verdict: the rule's
p99 over the engine alone's, the median of `--rounds` rounds (target <= 1.05), the sidecar's
restores_skipped, and the pages the rule still loaded (its probes of the slow tier).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

import numpy as np

from api.engine.client import SidecarClient
from loadtest.kit.procs import SlowTierSidecar, start_sidecar
from loadtest.kit.vllm.engine import Engine
from loadtest.kit.vllm.tiny_model import build

WARM = 3


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(2, 1024) for _ in range(length)] for _ in range(n)]


def slow_sidecar(data: str, delay_ms: int) -> SlowTierSidecar:
    args = ("--data-dir", data, "--host-pool", "1GiB", "--log-level", "warning")
    return SlowTierSidecar(*args, delay_ms=delay_ms).wait_ready()


def summary(ms: list[float]) -> dict:
    return {f"p{q}": round(float(np.percentile(ms, q)), 1) for q in (50, 90, 99)} | {
        "max": round(max(ms), 1),
        "n": len(ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--delay-ms", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-size", default="small")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-slow-tier-")
    model = build(f"{tmp}/model", size=args.model_size)
    env = {"ENGINE_MAX_MODEL_LEN": str(args.length + 64), "ENGINE_KV_BYTES": str(256 << 20)}
    rounds = prompts(args.prompts * args.rounds, args.length, 1)  # each round its own prompts
    warm, norule = prompts(WARM, args.length, 2), prompts(10, args.length, 4)
    fresh = prompts(WARM, args.length, 3)
    data = f"{tmp}/data"
    sc = start_sidecar("--data-dir", data, "--host-pool", "1GiB")
    writer = Engine(model, sc.socket_url, **env)
    for p in rounds + warm + norule:
        writer.ask(op="generate", prompts=[p], max_tokens=1)
    writer.close()
    SidecarClient(sc.url).request("POST", "/v1/flush")
    sc.stop()
    slow = slow_sidecar(data, args.delay_ms)
    arms = {
        "none": Engine(model, "-", ENGINE_CONNECTOR="none", **env),
        "rule": Engine(model, slow.socket_url, ENGINE_RESTORE_COST="1", **env),
    }
    ttft: dict[str, list[float]] = {arm: [] for arm in arms}
    try:
        for e in arms.values():  # warm-up: prefills (timed), then the slow tier (timed)
            for p in fresh + warm:
                e.ask(op="ttft", prompt=p)
        mine = SidecarClient(slow.socket_url)  # the engines' own namespaces
        loaded = sum(ns["hits"] for ns in mine.stats()["namespaces"].values())
        ratios = []
        for r in range(args.rounds):  # each round: the engine alone, then the rule
            got: dict[str, list[float]] = {arm: [] for arm in arms}
            for arm, e in arms.items():  # one arm after the other: two engines computing
                for p in rounds[
                    r * args.prompts : (r + 1) * args.prompts
                ]:  # in turn slow each other
                    got[arm].append(e.ask(op="ttft", prompt=p)["seconds"] * 1e3)
            ratios.append(float(np.percentile(got["rule"], 99) / np.percentile(got["none"], 99)))
            for arm in arms:
                ttft[arm] += got[arm]
        stats = mine.stats()["namespaces"]
        skipped = sum(ns["restores_skipped"] for ns in stats.values())
        loaded = (
            sum(ns["hits"] for ns in stats.values()) - loaded
        )  # pages the rule still loaded (probes)
        arms["none"].close()
        arms["rule"].close()
        no = Engine(model, slow.socket_url, ENGINE_RESTORE_COST="0", **env)
        ttft["no-rule"] = [no.ask(op="ttft", prompt=p)["seconds"] * 1e3 for p in norule]
        no.close()
    finally:
        slow.stop()
    out = {arm: summary(ms) for arm, ms in ttft.items()}
    for arm, s in out.items():
        print(json.dumps({"arm": arm, **s}))
    ratio = float(np.median(ratios))
    print(
        json.dumps(
            {
                "figure": "slow_tier_p99_ratio",
                "rule_over_none": round(ratio, 3),
                "limit": 1.05,
                "met": ratio <= 1.05,
                "rounds": [round(r, 3) for r in ratios],
                "pooled": round(out["rule"]["p99"] / out["none"]["p99"], 3),
                "restores_skipped": skipped,
                "pages_loaded_by_rule": loaded,
                "delay_ms": args.delay_ms,
                "length": args.length,
                "model": args.model_size,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
