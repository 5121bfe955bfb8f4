"""`make bench-engines` on a tiny model, one round: every state of the sidecar arm is proven
by the engine's num_cached_tokens, the greedy tokens and the sidecar's own counters, and the
proof turns a run down when any of them disagrees. No timing is asserted."""

from __future__ import annotations

import json

from loadtest.engines import bench as bench_engines
from loadtest.engines import lib as lib

BLOCK = 32


def test_a_tiny_bench_run_proves_every_restore(tmp_path):
    out = tmp_path / "out"
    assert (
        bench_engines.main(
            [
                "--out",
                str(out),
                "--rounds",
                "1",
                "--warmup",
                "0",
                "--lengths",
                "96,101",
                "--arms",
                "sidecar",
                "--model-size",
                "tiny",
                "--kv-mib",
                "16",
                "--host-pool-mib",
                "64",
                "--throughput-prompts",
                "0",
                "--skip-share",
                "--settle",
                "0.2",
            ]
        )
        == 0
    )
    recs = [json.loads(x) for x in (out / "bench-engines.jsonl").read_text().splitlines()]
    three = [r for r in recs if r["figure"] == "three_states"]
    assert {(r["length"], r["state"]) for r in three} == {
        (n, s) for n in (96, 101) for s in ("cold", "hit", "restored", "cross")
    }
    assert all(r["proven"] == r["of"] == 1 for r in three), [r["unproven_because"] for r in three]
    page = bench_engines.kv_page_bytes("tiny")
    for r in three:
        want = 0 if r["state"] == "cold" else r["length"] - 1
        assert r["cached"] == want
        loaded = {
            "cold": 0,
            "hit": 1,
            "restored": lib.blocks_for(r["length"] - 1, BLOCK),
            "cross": lib.blocks_for(r["length"] - 1, BLOCK),
        }[r["state"]]
        if r["length"] % BLOCK == 1 and r["state"] == "hit":
            loaded = 0  # a 1-token tail: vLLM's own blocks are the whole hit
        assert r["bytes_loaded"] == loaded * page, r
    assert {r["length"] for r in recs if r["figure"] == "restore"} == {96, 101}
    assert "| sidecar | 96 | restored |" in (out / "bench-engines.md").read_text()

    # the same runs, with one fact changed, no longer count
    runs = json.loads((out / "bench-engines-runs.json").read_text())
    run = next(r for r in runs if r["length"] == 101)
    st = run["states"]["restored"]
    cold = run["states"]["cold"]["tokens"]
    delta = lib.Counters(**st["delta"])  # the sidecar's counters across the restore
    assert delta.hits == lib.blocks_for(100, BLOCK) and delta.misses == 0
    assert lib.prove(st["tokens"], cold, st["cached"], 100, 0, BLOCK, page, delta).ok
    assert not lib.prove(
        st["tokens"][:-1] + [st["tokens"][-1] + 1], cold, st["cached"], 100, 0, BLOCK, page, delta
    ).ok
    assert not lib.prove(st["tokens"], cold, st["cached"] - 1, 100, 0, BLOCK, page, delta).ok
    fewer = lib.Counters(delta.hits - 1, 0, delta.bytes_out - page)
    assert not lib.prove(st["tokens"], cold, st["cached"], 100, 0, BLOCK, page, fewer).ok
