"""`make bench-engines`: its arithmetic, its restore proofs and its figures, on runs built
here (no engine: tests/engines/vllm/test_bench_engines_run.py runs the bench itself on a
tiny model). No timing is asserted: the speed targets live in the bench."""

import json
import os

import pytest

from loadtest.engines import lib as lib
from loadtest.engines.report import restore_figures, tables
from loadtest.engines.share import share_record

B = 32


def test_summary_percentile_and_ratios():
    s = lib.summary([3.0, 1.0, None, 2.0])
    assert (s["median"], s["min"], s["max"], s["runs"]) == (2.0, 1.0, 3.0, [3.0, 1.0, 2.0])
    assert lib.summary([])["median"] is None
    xs = list(range(1, 101))
    assert (
        lib.percentile(xs, 50) == 50
        and lib.percentile(xs, 99) == 99
        and lib.percentile(xs, 100) == 100
    )
    assert lib.percentile([], 50) is None
    assert lib.paired_ratios([2.0, 3.0, None], [1.0, 0, 2.0]) == [2.0]
    assert lib.ratio(1.0, 0) is None and lib.ratio(3.0, 2.0) == 1.5


def test_restore_limit_and_bandwidth():
    # 100 MB copied in 10 ms: the restore may take 10 / 0.8 + 5 = 17.5 ms
    assert lib.restore_limit_ms(100_000_000, 0.010) == pytest.approx(17.5)
    assert lib.gbps(100_000_000, 0.010) == pytest.approx(10.0)
    assert lib.gbps(1, 0) is None
    assert lib.kv_page_bytes(12, 4, 64, 32) == 786432  # the bench model: 768 KiB a block


@pytest.mark.parametrize("n", [1024, 1000, 993, 97, 31])
def test_expected_cached_by_arm(n):
    local = lib.local_hit(n, B)
    assert local % B == 0 and local <= n - 1 < local + B
    assert lib.expected_cached("none", n, B, local) == local
    assert lib.expected_cached("sidecar", n, B, local) == n - 1  # every token but the last
    lm = lib.expected_cached("lmcache", n, B, local)
    assert lm == (n - 1 if n % 256 == 0 else max(local, n // 256 * 256))
    assert lib.expected_cached("lmcache", n, B, 0) <= n - 1


def test_blocks_for_counts_the_partial_block():
    assert [lib.blocks_for(t, B) for t in (0, 1, 32, 33, 1023)] == [0, 1, 1, 2, 32]


def counters(hits, misses=0, page=100):
    return lib.Counters(hits, misses, hits * page)


def test_a_restore_is_proven_by_tokens_cached_and_counters():
    cold = [5, 6, 7]
    # a restore of 1,023 tokens after a reset: 32 blocks, all counted by the sidecar
    ok = lib.prove(cold, cold, 1023, 1023, 0, B, 100, counters(32))
    assert ok.ok and ok.blocks == 32 and ok.nbytes == 3200 and not ok.why
    # an in-engine hit: vLLM's own 992 tokens, the sidecar's last block
    hit = lib.prove(cold, cold, 1023, 1023, 992, B, 100, counters(1))
    assert hit.ok and hit.blocks == 1
    # each way a run fails to count
    assert "greedy tokens" in lib.prove([5, 6, 8], cold, 1023, 1023, 0, B, 100, counters(32)).why[0]
    assert (
        "num_cached_tokens 992" in lib.prove(cold, cold, 992, 1023, 0, B, 100, counters(31)).why[0]
    )
    assert any(
        "hits moved by 31" in w
        for w in lib.prove(cold, cold, 1023, 1023, 0, B, 100, counters(31)).why
    )
    assert any(
        "misses" in w for w in lib.prove(cold, cold, 1023, 1023, 0, B, 100, counters(32, 1)).why
    )
    bad_bytes = lib.Counters(32, 0, 31 * 100)
    assert any(
        "bytes_out" in w for w in lib.prove(cold, cold, 1023, 1023, 0, B, 100, bad_bytes).why
    )
    # without counters (LMCache, no connector) the proof rests on the engine's own counter
    assert lib.prove(cold, cold, 1023, 1023, 0, B, 100, None).ok


def test_counters_sum_namespaces_and_subtract():
    stats = {
        "namespaces": {
            "a": {"hits": 3, "misses": 1, "bytes_out": 30},
            "b": {"hits": 2, "misses": 0, "bytes_out": 20},
        }
    }
    c = lib.Counters.of(stats)
    assert (c.hits, c.misses, c.bytes_out) == (5, 1, 50)
    d = c - lib.Counters(1, 1, 10)
    assert (d.hits, d.misses, d.bytes_out) == (4, 0, 40)


def test_trace_prompts_share_tokens_exactly_as_far_as_their_prefix():
    a, b = lib.trace_prompt([0, 1, 2], B), lib.trace_prompt([0, 1, 9], B)
    assert len(a) == 3 * B and a[: 2 * B] == b[: 2 * B] and a[2 * B :] != b[2 * B :]
    assert lib.trace_prompt([0, 1, 2], B) == a  # deterministic
    assert all(2 <= t < 1024 for t in a)


def test_multi_turn_slice_keeps_whole_conversations_in_order():
    reqs = [
        {"hash_ids": [0, 1, 2]},
        {"hash_ids": [0, 5]},
        {"hash_ids": [0, 1, 2, 3]},
        {"hash_ids": [0, 7, 8]},
        {"hash_ids": [0, 1, 4]},
        {"hash_ids": [0, 7, 8, 9]},
        {"hash_ids": [0, 5, 6]},
    ]
    conv = lib.conversations(reqs)
    assert conv == [0, 1, 0, 3, 0, 3, 1]  # block 0 alone (shared by all) makes no conversation
    assert lib.multi_turn_slice(reqs, 1) == [0, 2, 4]
    assert lib.multi_turn_slice(reqs, 2) == [0, 1, 2, 4, 6]
    assert lib.multi_turn_slice(reqs, 5, min_turns=3) == [0, 2, 4]
    assert lib.multi_turn_slice(reqs, 5, max_blocks=3) == [1, 6]  # conversations 0 and 3 run long


def test_within_is_relative():
    assert lib.within(0.50, 0.52) and not lib.within(0.40, 0.52)
    assert lib.within(0.0, 0.0) and not lib.within(0.01, 0.0)


def run(rnd, arm, n, ttft, cached, ok=True, nbytes=None, memcpy=None, kept=True):
    """One fabricated bench run: states -> (ttft, cached)."""
    states = {}
    for s, (t, c) in ttft.items():
        states[s] = {
            "ttft": t,
            "cached": c,
            "tokens": [1],
            "proof": {
                "ok": ok if s != "cold" else True,
                "why": [] if ok else ["x"],
                "blocks": 0,
                "nbytes": (nbytes or {}).get(s, 0),
            },
        }
    return {
        "round": rnd,
        "kept": kept,
        "arm": arm,
        "length": n,
        "memcpy_s": memcpy,
        "load": 1.0,
        "states": states,
    }


def fabricated():
    runs = []
    for rnd in (0, 1, 2):
        kept = rnd > 0
        runs.append(run(rnd, "none", 1024, {"cold": (1.00, 0), "hit": (0.080, 992)}, 0, kept=kept))
        runs.append(
            run(
                rnd,
                "sidecar",
                1024,
                {
                    "cold": (1.02, 0),
                    "hit": (0.050 + rnd / 1000, 1023),
                    "restored": (0.060 + rnd / 1000, 1023),
                    "cross": (0.065, 1023),
                },
                0,
                nbytes={"hit": 1_000_000, "restored": 33_000_000},
                memcpy=0.004,
                kept=kept,
            )
        )
        runs.append(
            run(
                rnd,
                "lmcache",
                1024,
                {
                    "cold": (1.03, 0),
                    "hit": (0.049, 1023),
                    "restored": (0.070, 1023),
                    "cross": (0.075, 1023),
                },
                0,
                nbytes={"hit": 1_000_000, "restored": 33_000_000},
                kept=kept,
            )
        )
        runs.append(
            {
                "round": rnd,
                "kept": kept,
                "arm": "none",
                "batch": True,
                "seconds": 10.0,
                "tokens": 1000,
                "cached": [0],
                "load": 1.0,
            }
        )
        runs.append(
            {
                "round": rnd,
                "kept": kept,
                "arm": "sidecar",
                "batch": True,
                "seconds": 10.2,
                "tokens": 1000,
                "cached": [0],
                "load": 1.0,
            }
        )
    return runs


def test_figures_from_a_fabricated_run():
    recs = restore_figures(fabricated(), ["none", "sidecar", "lmcache"], [1024], 786432)
    by = {(r["figure"], r.get("arm"), r.get("state"), r.get("what")): r for r in recs}
    hit = by[("three_states", "sidecar", "hit", None)]
    assert hit["ttft_s"]["runs"] == pytest.approx([0.051, 0.052])  # the warm-up round dropped
    assert hit["proven"] == 2 and hit["of"] == 2
    rest = by[("restore", "sidecar", None, None)]
    # 10 ms over the hit each round; 32 MB beyond the hit's; memcpy of 33 MB in 4 ms
    assert rest["overhead_s"]["median"] == pytest.approx(0.010)
    assert rest["bytes"] == 32_000_000 and rest["gbps"] == pytest.approx(3.2)
    copy = 0.004 * 32 / 33
    assert rest["memcpy_s"]["median"] == pytest.approx(copy)
    assert rest["limit_s"]["median"] == pytest.approx(copy / 0.8 + 0.005)
    assert rest["met"] is False  # 10 ms > 9.85 ms
    lm = by[("restore", "lmcache", None, None)]  # LMCache uses the sidecar's memcpy of that round
    assert lm["overhead_s"]["median"] == pytest.approx(0.021) and lm["pairs"] == 2
    hit_ratio = by[("issue33", "sidecar", None, "in-engine hit / no connector")]
    assert hit_ratio["ratio_of_medians"] == pytest.approx(0.0515 / 0.080) and hit_ratio["met"]
    vs_lm = by[("issue33", "sidecar", None, "restored / LMCache restored")]
    assert vs_lm["ratio_of_medians"] == pytest.approx(0.0615 / 0.070) and vs_lm["met"]
    cold = by[("store_on_miss", "sidecar", None, "cold TTFT")]
    assert cold["ratio_of_medians"] == pytest.approx(1.02) and cold["met"]
    batch = by[("store_on_miss", "sidecar", None, "batch time (unique prompts)")]
    assert batch["ratio_of_medians"] == pytest.approx(1.02) and batch["paired"]["runs"] == [
        1.02,
        1.02,
    ]
    text = tables(recs)
    assert "| sidecar | 1024 | restored |" in text and "NOT met" in text
    json.dumps(recs)  # every record is one JSON line


def test_unproven_runs_stay_out_of_the_figures():
    runs = fabricated()
    for r in runs:
        if r.get("arm") == "sidecar" and not r.get("batch") and r["round"] == 2:
            r["states"]["restored"]["proof"] = {
                "ok": False,
                "why": ["num_cached_tokens 992, want 1023"],
                "blocks": 0,
                "nbytes": 0,
            }
    recs = restore_figures(runs, ["none", "sidecar"], [1024], 786432)
    three = next(
        r
        for r in recs
        if r["figure"] == "three_states" and r["arm"] == "sidecar" and r["state"] == "restored"
    )
    assert (
        three["proven"] == 1
        and three["of"] == 2
        and three["ttft_s"]["runs"] == pytest.approx([0.061])
    )
    assert three["unproven_because"] == ["num_cached_tokens 992, want 1023"]
    rest = next(r for r in recs if r["figure"] == "restore")
    assert rest["pairs"] == 1


def test_share_record_against_the_plan():
    res = [{"ttft": 0.01 * i, "blocks": 10, "hit": 5} for i in range(1, 11)]
    stats = [{"namespaces": {"n": {"hits": 50, "misses": 0, "bytes_out": 0, "capacity_pages": 64}}}]
    rec = share_record("shared", res, stats, 0.52, 2, 10, 80, 64, 2, [1.0, 2.0])
    assert rec["hit_rate_blocks"] == 0.5 and rec["hit_rate_counters"] == 0.5 and rec["met"]
    assert rec["ttft_p50_s"] == pytest.approx(0.05) and rec["ttft_p99_s"] == pytest.approx(0.10)
    assert not share_record("split", res, stats * 2, 0.30, 2, 10, 80, 64, 2, [1.0])["met"]


def test_sidecar_env_is_set_only_while_the_sidecar_starts(monkeypatch):
    monkeypatch.delenv("KVB_TEST_A", raising=False)
    monkeypatch.setenv("KVB_TEST_B", "kept")
    with lib.sidecar_env(["KVB_TEST_A=1", "KVB_TEST_B=x=y"]):
        assert os.environ["KVB_TEST_A"] == "1" and os.environ["KVB_TEST_B"] == "x=y"
    assert "KVB_TEST_A" not in os.environ and os.environ["KVB_TEST_B"] == "kept"


def test_the_chart_draws_the_memcpy_floor_and_the_target(tmp_path):
    from loadtest.engines import chart as chart

    recs = restore_figures(fabricated(), ["none", "sidecar", "lmcache"], [1024], 786432)
    xs, floor, target = chart.floors(recs)
    copy = 0.004 * 32 / 33
    assert xs == [1024]
    assert floor[0] == pytest.approx(51.5 + copy * 1e3)  # hit median + memcpy
    assert target[0] == pytest.approx(51.5 + (copy / 0.8 + 0.005) * 1e3)
    path = tmp_path / "c.png"
    chart.draw(recs, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
