"""`make bench-serve`'s arithmetic (loadtest/serving/lib.py): the trace's conversations
made into token prompts, the `vllm serve` command kept in step with deploy/engine-vllm.yaml,
and the report's figures and targets."""

from __future__ import annotations

import json
import random

import pytest

from loadtest.serving import fleet as fl
from loadtest.serving import lib as sl

ROWS = [  # two conversations (shared prefixes of 2+ blocks) and one lone request
    {"input_length": 1000, "output_length": 100, "hash_ids": [0, 1]},
    {"input_length": 600, "output_length": 10, "hash_ids": [0, 9]},
    {"input_length": 1600, "output_length": 50, "hash_ids": [0, 1, 2, 3]},
    {"input_length": 2100, "output_length": 30, "hash_ids": [0, 1, 2, 3, 4, 5]},
    {"input_length": 700, "output_length": 20, "hash_ids": [0, 7, 8]},
    {"input_length": 900, "output_length": 20, "hash_ids": [0, 7, 8, 6]},
]


def test_turns_grow_by_the_traces_new_tokens():
    convs = sl.conversations(ROWS, scale=16)
    assert [c.cid for c in convs] == [0, 4]
    first = convs[0]
    # 1000/16 -> 63; then 1600/16 = 100 minus 63 and the answer's 100/16 = 7 -> 30; then 2100/16 = 132
    # minus 100 and 50/16 = 4 -> 28
    assert first.turns == (sl.Turn(63, 7), sl.Turn(30, 4), sl.Turn(132 - 100 - 4, 2))
    prompt, answer = [], []
    for k, turn in enumerate(first.turns):
        nxt = sl.next_prompt(prompt, answer, first, k)
        assert nxt[: len(prompt) + len(answer)] == prompt + answer, (
            "turn k extends turn k-1 and its answer"
        )
        assert len(nxt) == len(prompt) + len(answer) + turn.new_tokens
        prompt, answer = nxt, [5] * turn.max_tokens
    assert all(2 <= t < 1024 for t in prompt)


def test_user_tokens_are_deterministic_and_distinct():
    assert sl.user_tokens(3, 1, 40) == sl.user_tokens(3, 1, 40)
    assert sl.user_tokens(3, 1, 40) != sl.user_tokens(3, 2, 40)
    assert sl.user_tokens(3, 1, 40) != sl.user_tokens(4, 1, 40)


def test_conversations_are_cut_at_the_length_limit():
    convs = sl.conversations(ROWS, scale=16, max_prompt=120)
    assert [len(c.turns) for c in convs] == [2, 2]  # conversation 0 cut after 2 of its 3 turns
    assert sum(t.new_tokens + t.max_tokens for t in convs[0].turns) <= 120


def test_routes_and_assignment():
    assert [sl.route("rr", s, 7, 4) for s in range(5)] == [0, 1, 2, 3, 0]
    sticky = {sl.route("sticky", s, cid, 4) for s in range(10) for cid in [11]}
    assert len(sticky) == 1
    assert len({sl.route("sticky", 0, cid, 4) for cid in range(40)}) == 4
    convs = [sl.Conversation(i, ()) for i in range(10)]
    users = sl.assign(convs, 3, offset=1)
    assert [[c.cid for c in u] for u in users] == [[1, 4, 7], [2, 5, 8], [3, 6, 9]]


def test_every_arm_plays_the_same_requests_on_the_same_engines():
    assert sl.per_user(64, 16, 1) == 5 and sl.per_user(65, 16, 1) == 6
    assert sl.per_user(0, 3, 2) == 2
    for bad in ((64, 0, 1), (-1, 4, 1), (4, 4, -1)):
        with pytest.raises(ValueError):
            sl.per_user(*bad)
    # rr from (user, n) alone: user u's n-th request on engine (u + n) % engines
    plan = [[sl.route("rr", u + n, 0, 4) for n in range(3)] for u in range(2)]
    assert plan == [[0, 1, 2], [1, 2, 3]]


def test_serve_args_keep_the_manifests_flags():
    manifest = sl.manifest_args()
    conn = sl.sidecar_connector("unix:///tmp/x.sock")
    args = sl.serve_args("/m", 9000, conn, ["--max-model-len=512"])
    names = {a.split("=", 1)[0] for a in args}
    for a in manifest[1:]:
        name = a.split("=", 1)[0]
        assert name in names, f"the bench's vllm serve lacks the manifest's {name}"
        if name not in ("--host", "--port", "--kv-transfer-config"):
            assert a in args
    cfg = json.loads(
        next(a for a in args if a.startswith("--kv-transfer-config=")).split("=", 1)[1]
    )
    want = json.loads(
        next(a for a in manifest if a.startswith("--kv-transfer-config=")).split("=", 1)[1]
    )
    want["kv_connector_extra_config"]["sidecar_url"] = "unix:///tmp/x.sock"
    assert cfg == want
    assert args[:3] == ["/m", "--host=127.0.0.1", "--port=9000"]
    bare = sl.serve_args("/m", 9000, None)
    assert not any(a.startswith("--kv-transfer-config") for a in bare)


def rec(start: float, ttft: float, e2e: float, out: int = 4, error: str = "", n: int = 1) -> dict:
    return {
        "n": n,
        "start": start,
        "end": start + e2e,
        "ttft": ttft,
        "e2e": e2e,
        "out_tokens": out,
        "prompt_tokens": 100,
        "cached_tokens": 50,
        **({"error": error} if error else {}),
    }


def test_level_summary_drops_the_warm_up_and_counts_errors():
    recs = (
        [rec(10 + i, 0.1 * (i + 1), 1.0) for i in range(10)]
        + [rec(0, 9.0, 9.0, n=0)]  # a user's first, whenever it ended
        + [rec(20, 0, 1, error="500")]
    )
    s = sl.level_summary(recs, warmup=1)
    assert s["requests"] == 11 and s["errors"] == 1
    assert s["ttft_p50_s"] == 0.5 and s["ttft_p99_s"] == 1.0  # the 9 s warm-up is gone
    assert abs(s["req_s"] - 10 / 11) < 1e-9  # 10 ok over 10.0 .. 21.0
    assert abs(s["out_tok_s"] - 40 / 11) < 1e-9
    assert s["cached_tokens"] == 500


def test_counters_agree_within_a_page_a_load():
    assert sl.counters_agree(4, 127, loads=1, block=32)  # 3 blocks and a 31-token tail
    assert not sl.counters_agree(3, 127, loads=1, block=32)  # fewer pages than tokens
    assert not sl.counters_agree(6, 127, loads=1, block=32)  # pages nobody counted
    assert sl.counters_agree(0, 0, loads=0, block=32)
    # the split arm's run: 756 pages hit, 39 evicted between lookup and load (recomputed),
    # 25,356 tokens vLLM counted as external when it scheduled the loads
    assert sl.counters_agree(756 + 39, 25356, loads=40, block=32)
    assert not sl.counters_agree(756, 25356, loads=40, block=32)


def row(arm: str, level: int, p50: float, p99: float, rps: float) -> dict:
    return {
        "arm": arm,
        "policy": "rr",
        "users_per_engine": level,
        "ttft_p50_s": p50,
        "ttft_p99_s": p99,
        "req_s": rps,
    }


def test_targets_ratios_and_verdicts():
    rows = [
        row("shared", 4, 0.4, 1.0, 10),
        row("lmcache", 4, 0.6, 1.0, 9),
        row("none", 4, 1.0, 1.1, 5),
        row("shared", 1, 0.2, 0.9, 3),
        row("none", 1, 0.3, 0.8, 2),
    ]
    ts = {t["target"]: t for t in sl.targets(rows)}
    lm = ts["shared p50 TTFT / LMCache's at 4 users/engine"]
    assert abs(lm["ratio"] - 0.4 / 0.6) < 1e-9 and lm["met"] is True
    assert ts["shared p50 TTFT / no connector's at 4 users/engine"]["met"] is True  # 0.4 <= 0.5
    assert ts["shared req/s / LMCache's at 4 users/engine"]["met"] is True
    assert ts["shared p99 TTFT / no connector's at 1 users/engine"]["met"] is False  # 0.9 > 0.8
    assert ts["shared p99 TTFT / no connector's at 4 users/engine"]["met"] is True
    missing = sl.targets([row("shared", 4, 0.4, 1.0, 10)])
    assert missing[0]["met"] is None and "no figure" in sl.targets_text(missing)


def test_ratio_interval_tells_chance_from_a_difference():
    rnd = random.Random(3)
    base = [rnd.uniform(0.1, 1.0) for _ in range(100)] + [5.0, 6.0]
    same = [rnd.uniform(0.1, 1.0) for _ in range(100)] + [5.5, 4.8]
    lo, hi = sl.ratio_interval(same, base, 99)
    assert lo < 1.0 < hi  # two tails of the same law: chance
    assert sl.ratio_interval(same, base, 99) == (lo, hi)  # a fixed seed
    lo, hi = sl.ratio_interval([2 * x for x in base], base, 50)
    assert 1.4 < lo <= 2.0 <= hi < 2.8  # clear of 1: a difference
    assert sl.ratio_interval([], base, 99) is None


def test_targets_show_an_interval_that_holds_the_limit():
    rows = [row("shared", 1, 0.2, 0.9, 3), row("none", 1, 0.3, 0.8, 2)]
    rnd = random.Random(5)
    ttfts = {
        ("shared", "rr", 1): [rnd.uniform(0.1, 0.9) for _ in range(100)],
        ("none", "rr", 1): [rnd.uniform(0.1, 0.8) for _ in range(100)],
    }
    ts = sl.targets(rows, ttfts=ttfts)
    p99 = next(t for t in ts if t["target"].startswith("shared p99"))
    assert p99["met"] is False and p99["interval"] is not None
    text = sl.targets_text(ts)
    lo, hi = p99["interval"]
    assert (lo <= 1.0 <= hi) == ("within chance" in text)
    assert sl.targets(rows)[-1]["interval"] is None  # no request lists: no interval


def test_paired_interval_sees_a_difference_the_requests_spread_hides():
    rnd = random.Random(7)
    base = [rnd.uniform(0.05, 10.0) for _ in range(60)]  # cheap turns and long cold prompts
    faster = [x * rnd.uniform(0.55, 0.65) for x in base]  # 0.6x of each, request by request
    apart = sl.ratio_interval(faster, base, 50)
    keyed = lambda xs: {(i, 1): x for i, x in enumerate(xs)}  # noqa: E731
    lo, hi = sl.interval(keyed(faster), keyed(base), 50)
    assert 0.5 < lo <= 0.6 <= hi < 0.7  # paired: tight round the true 0.6
    assert hi - lo < (apart[1] - apart[0]) / 2
    assert sl.interval(keyed(faster), {(0, 1): 1.0}, 50) is not None  # other requests: apart
    assert sl.paired_ratio_interval([], 50) is None


def test_core_shares_split_the_cores_and_wrap_round_the_ring():
    assert [fl.core_share(i, 2, [0, 1, 2, 3]) for i in range(2)] == ["0,1", "2,3"]
    assert [fl.core_share(i, 4, [0, 1]) for i in range(4)] == ["0", "1", "0", "1"]
    assert [fl.core_share(i, 3, [4, 5, 6, 7]) for i in range(3)] == ["4", "5", "6"]
    assert fl.core_share(0, 1, [0, 1]) == "0,1"
    for bad in ((2, 2, [0, 1]), (0, 0, [0]), (0, 1, [])):
        with pytest.raises(ValueError):
            fl.core_share(*bad)


def test_report_keys_each_kept_request_by_user_and_number(tmp_path):
    from loadtest.serving import report as rep

    row = {"arm": "shared", "engines": 2, "policy": "rr", "users_per_engine": 1, "warmup": 1}
    lines = [
        {"user": 0, "n": 0, "ttft": 9.0},  # warm-up
        {"user": 0, "n": 1, "ttft": 0.2},
        {"user": 1, "n": 1, "ttft": 0.3},
        {"user": 1, "n": 2, "ttft": None, "error": "500"},
    ]
    (tmp_path / "requests-shared-2-rr-1.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines)
    )
    assert rep.kept_ttfts(tmp_path, row) == {(0, 1): 0.2, (1, 1): 0.3}
    assert rep.kept_ttfts(tmp_path, {**row, "arm": "none"}) == {}
