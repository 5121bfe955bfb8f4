"""`make bench-serve`'s second shape (loadtest/serving/trace_replay.py, issue 53): the trace's
requests made into prompts that share exactly the trace's shared prefixes, where a level's
time went, and the shape's targets with the sidecar at the product's defaults."""

from __future__ import annotations

import json

import pytest

from loadtest.serving import trace_replay as bt

ROWS = [
    {"timestamp": 1000, "input_length": 1000, "output_length": 100, "hash_ids": [0, 1]},
    {"timestamp": 1500, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 4000, "input_length": 900, "output_length": 3, "hash_ids": [0, 7]},
    {"timestamp": 5000, "input_length": 99999, "output_length": 20, "hash_ids": list(range(50))},
]


def test_trace_requests_share_exactly_the_traces_shared_prefixes():
    reqs = bt.trace_requests(ROWS, 4, scale=8, max_prompt=1024)
    block = bt.block_of(8)
    assert block == 64
    a, b, c, d = reqs
    assert (a.tokens, a.max_tokens, a.at) == (-(-1000 // 8), -(-100 // 8), 0.0)
    assert (b.at, c.at, d.at) == (0.5, 3.0, 4.0)  # seconds after the first, as the trace has it
    pa, pb, pc = a.prompt(block), b.prompt(block), c.prompt(block)
    assert len(pa) == a.tokens and len(pb) == b.tokens
    assert len(pa) < 2 * block and pb[: len(pa)] == pa  # a is blocks 0 and 1 (cut): b's start
    assert pc[:block] == pa[:block] and pc[block : 2 * block] != pa[block : 2 * block]
    assert d.tokens == 1024 and len(d.prompt(block)) == 1024  # cut to the longest prompt
    assert a.cid == b.cid != c.cid  # a conversation: 2+ blocks shared
    assert bt.trace_requests(ROWS, 4, scale=8, max_prompt=1024) == reqs  # deterministic
    assert bt.shared_fraction(reqs[:2]) == pytest.approx(2 / 5)
    with pytest.raises(ValueError):
        bt.block_of(7)


def test_a_sample_keeps_whole_conversations_in_the_traces_order():
    # request i is a turn of conversation i % 3 (requests 0, 1, 2): blocks 0, 100 + i % 3
    rows = [
        {"timestamp": i, "input_length": 192, "output_length": 1, "hash_ids": [0, 100 + i % 3, i]}
        for i in range(12)
    ]
    assert bt.sample(rows, 1) == rows
    kept = {k: [r["timestamp"] for r in bt.sample(rows, k)] for k in range(2, 8)}
    assert kept[5] == [i for i in range(12) if i % 3 in (0, 1)]  # sha256("0"), ("1") 0 mod 5
    assert kept[2] == [] and kept[3] == list(range(12))
    assert bt.sample(rows, 5) == bt.sample(list(rows), 5)  # deterministic
    with pytest.raises(ValueError):
        bt.sample(rows, 0)


def test_prefix_fraction_counts_what_an_earlier_prefix_covers():
    reqs = bt.trace_requests(ROWS[:3], 3, scale=8, max_prompt=1024)
    a, b, c = reqs
    block = bt.block_of(8)
    # b restores a's blocks 0 and 1 (2 x 64 tokens); c restores block 0 only
    want = (2 * block + block) / (a.tokens + b.tokens + c.tokens)
    assert bt.prefix_fraction(reqs, block) == pytest.approx(want)
    assert bt.prefix_fraction(reqs[:1], block) == 0.0
    # a later level or round: the requests before it are in the caches too
    assert bt.prefix_fraction(reqs[1:], block, reqs[:1]) == pytest.approx(
        (2 * block + block) / (b.tokens + c.tokens)
    )


METRICS = """# HELP vllm:request_queue_time_seconds x
vllm:request_queue_time_seconds_sum{{engine="0",model_name="m"}} {q}
vllm:request_queue_time_seconds_count{{engine="0",model_name="m"}} {n}
vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {p}
vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} {n}
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {t}
vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {n}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="1.0",model_name="m"}} 99
"""


def test_breakdown_means_vllms_histograms_and_the_connectors_timeline():
    before = [bt.vllm_times(METRICS.format(q=1, p=10, t=12, n=2))]
    after = [bt.vllm_times(METRICS.format(q=5, p=30, t=40, n=6))]
    timeline = [
        {"kind": "request", "t": 1, "lookup_s": 0.4, "late_steps": 2},
        {"kind": "save", "t": 1, "save_s": 0.2, "save_pages": 10, "skipped": 3},
        {"kind": "save", "t": 2, "save_s": 0.2, "save_pages": 5, "skipped": 0},
        {"kind": "set", "t": 2, "set_s": 0.8, "pages": 12},
        {"kind": "load", "t": 3, "load_s": 0.4, "load_pages": 4},
    ]
    b = bt.breakdown(before, after, timeline, 4)
    assert b["queue_s"] == pytest.approx(1.0) and b["prefill_s"] == pytest.approx(5.0)
    assert b["ttft_s"] == pytest.approx(7.0)
    assert b["lookup_s"] == pytest.approx(0.1) and b["save_wait_s"] == pytest.approx(0.1)
    assert b["set_s"] == pytest.approx(0.2) and b["load_s"] == pytest.approx(0.1)
    assert (b["pages_saved"], b["pages_skipped"], b["late_steps"]) == (12, 3, 2)
    assert bt.within(timeline, 2, 2.5) == timeline[2:4]
    assert "lookup_s" not in bt.breakdown(before, after, [], 4)  # no connector: vLLM's only


def row(arm: str, p50: float, p99: float, req_s: float, level: int = 4) -> dict:
    return {
        "arm": arm,
        "policy": "rr",
        "users_per_engine": level,
        "ttft_p50_s": p50,
        "ttft_p99_s": p99,
        "req_s": req_s,
    }


def test_trace_targets_judge_the_product_defaults():
    rows = [
        row("defaults", 4.0, 10.0, 1.0),
        row("shared", 3.9, 9.8, 1.0),
        row("lmcache", 5.0, 10.5, 0.9),
        row("none", 8.0, 9.0, 0.5),
    ]
    ts = {t["target"]: t for t in bt.targets(rows, "rr")}
    assert len(ts) == 5
    p50 = ts["defaults ttft_p50_s / lmcache's at 4 users/engine"]
    assert p50["ratio"] == pytest.approx(0.8) and p50["met"] is True
    assert ts["defaults ttft_p99_s / none's at 4 users/engine"]["met"] is False  # 10 / 9
    assert ts["defaults req_s / lmcache's at 4 users/engine"]["met"] is True  # above
    tier = ts["defaults ttft_p99_s / shared's at 4 users/engine"]
    assert tier["limit"] == bt.TARGET_FILE_TIER_P99 and tier["met"] is True
    missing = bt.targets([row("defaults", 1, 1, 1)], "rr")
    assert all(t["met"] is None for t in missing)


def test_the_report_pairs_trace_requests_by_their_trace_index(tmp_path):
    from loadtest.serving import report as rep

    base = {"engines": 2, "policy": "rr", "users_per_engine": 4, "warmup": 1, "shape": "trace"}
    for arm, ttfts in (("defaults", [9.0, 1.0, 2.0]), ("lmcache", [9.0, 3.0, 4.0])):
        lines = [
            {"user": 0, "n": 0, "cid": 0, "ttft": ttfts[0]},  # warm-up
            {"user": 0, "n": 1, "cid": 1 if arm == "defaults" else 2, "ttft": ttfts[1]},
            {"user": 1, "n": 1, "cid": 2 if arm == "defaults" else 1, "ttft": ttfts[2]},
        ]
        path = tmp_path / f"requests-trace-{arm}-2-rr-4.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    mine = rep.kept_ttfts(tmp_path, {**base, "arm": "defaults"})
    theirs = rep.kept_ttfts(tmp_path, {**base, "arm": "lmcache"})
    assert mine == {1: 1.0, 2: 2.0} and theirs == {2: 3.0, 1: 4.0}
    # the same request in both arms, whichever user sent it
    assert mine.keys() == theirs.keys()


def test_rounds_pool_into_one_row_a_level_paired_by_round(tmp_path):
    from loadtest.serving import report as rep

    rows = []
    for arm, per_round in (("defaults", [[1.0, 2.0], [3.0, 4.0]]), ("lmcache", [[2.0, 2.0]] * 2)):
        for rnd, ttfts in enumerate(per_round):
            rows.append(
                {
                    **row(arm, ttfts[0], ttfts[1], 1.0 + rnd),
                    "engines": 2,
                    "shape": "trace",
                    "warmup": 0,
                    "round": rnd,
                    "vllm_tokens": {"local_compute": 10, "external_kv_transfer": 5},
                }
            )
            tag = f"trace-{arm}-2-rr-4" + (f"-r{rnd}" if rnd else "")
            lines = [{"user": 0, "n": i, "cid": i, "ttft": t} for i, t in enumerate(ttfts)]
            (tmp_path / f"requests-{tag}.jsonl").write_text(
                "".join(json.dumps(x) + "\n" for x in lines)
            )
    merged, ttfts = rep.pooled(tmp_path, rows)
    assert len(merged) == 2 and {m["rounds"] for m in merged} == {2}
    mine = next(m for m in merged if m["arm"] == "defaults")
    assert mine["req_s"] == pytest.approx(1.5)
    assert mine["vllm_tokens"] == {"local_compute": 20, "external_kv_transfer": 10}
    assert ttfts[("defaults", "rr", 4)] == {(0, 0): 1.0, (0, 1): 2.0, (1, 0): 3.0, (1, 1): 4.0}
    assert ttfts[("defaults", "rr", 4)].keys() == ttfts[("lmcache", "rr", 4)].keys()
    assert mine["ttft_p99_s"] == 4.0  # over both rounds' requests (round 0's is 2.0)
    one, _ = rep.pooled(tmp_path, [r for r in rows if r["round"] == 0])
    assert "rounds" not in one[0] and one[0]["ttft_p50_s"] == 1.0


def test_the_best_case_is_what_a_cache_that_kept_every_prefix_computes():
    def tokens(arm: str, computed: int) -> dict:
        r = row(arm, 1.0, 2.0, 1.0)
        r["trace_prefix"] = 0.4
        r["vllm_tokens"] = {
            "local_compute": computed,
            "local_cache_hit": 100,
            "external_kv_transfer": 1000 - 100 - computed,
        }
        return r

    (line,) = bt.best_case([tokens("lmcache", 750), tokens("defaults", 650)], "rr")
    assert "1,000 prompt tokens, 40% in an earlier prefix" in line
    assert "lmcache 750, defaults 650" in line
    assert "kept everything: 600 (0.80x LMCache's)" in line
    assert bt.best_case([tokens("lmcache", 750)], "sticky") == []
    (alone,) = bt.best_case([tokens("none", 900)], "rr")
    assert alone.endswith("(no lmcache arm)")
