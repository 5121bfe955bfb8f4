"""The second shape of `make bench-serve` (issue 53): the trace's requests as the trace has
them, free of vLLM and Locust so the core suite checks it.

    request i:  its hash blocks, each `512 / scale` tokens of its own (lib.
                block_tokens): requests sharing a trace prefix share exactly that prefix
                of vLLM blocks; cut to `max_prompt` tokens and to its input length scaled;
                its answer the output length scaled; sent in the trace's order, at its
                timestamp x `time_scale` after the first (0: as fast as the users go)
    routing:    rr (request i to engine i mod n) or sticky (its conversation's sha256)
    sample k:   only the conversations whose sha256 is 0 mod k, every turn in the trace's
                order (the trace's next turn of a conversation comes thousands of requests
                later: a slice of every conversation shares little beyond block 0)

`breakdown` is where a level's time went, per request: vLLM's own histograms (waiting for
a place in the batch, prefill, time to first token) as before/after deltas of /metrics, and
the connector's timeline (api/engine/vllm_timeline.py): the lookup's wait, the loads, the
saves the step waited for, the sets behind it and the blocks kept for them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.engines import lib as lib

TRACE_BLOCK = 512  # tokens a trace hash block stands for
VLLM_TIMES = (
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "time_to_first_token_seconds",
)


@dataclass(frozen=True)
class TraceRequest:
    idx: int  # its row in the trace
    cid: int  # its conversation (the earliest request it shares 2+ blocks with)
    hash_ids: tuple[int, ...]
    tokens: int  # the prompt's length
    max_tokens: int
    at: float  # seconds after the first request, as the trace has it

    def prompt(self, block: int) -> list[int]:
        return lib.trace_prompt(self.hash_ids, block)[: self.tokens]


def block_of(scale: int) -> int:
    if scale < 1 or TRACE_BLOCK % scale:
        raise ValueError(f"scale {scale} does not divide a {TRACE_BLOCK}-token trace block")
    return TRACE_BLOCK // scale


def trace_requests(
    rows: Sequence[dict], count: int, scale: int = 4, max_prompt: int = 4096
) -> list[TraceRequest]:
    """The first `count` requests of the trace, scaled by `scale` (a 512-token hash block
    becomes 512 / scale tokens), each prompt at most `max_prompt` tokens."""
    block = block_of(scale)
    conv = lib.conversations(rows[:count])
    t0 = rows[0]["timestamp"] if rows else 0
    out = []
    for i, r in enumerate(rows[:count]):
        ids = tuple(r["hash_ids"][: max(1, max_prompt // block)])
        tokens = min(len(ids) * block, -(-r["input_length"] // scale), max_prompt)
        out.append(
            TraceRequest(
                i,
                conv[i],
                ids,
                max(2, tokens),
                max(1, -(-r["output_length"] // scale)),
                (r["timestamp"] - t0) / 1e3,
            )
        )
    return out


def sample(rows: Sequence[dict], k: int) -> list[dict]:
    """The trace's rows of every conversation whose id's sha256 is 0 mod `k`, in order
    (`k` 1: every row)."""
    if k < 1:
        raise ValueError(f"sample {k}: keep every k-th conversation, k >= 1")
    if k == 1:
        return list(rows)
    conv = lib.conversations(rows)
    keep = lambda c: int(hashlib.sha256(str(c).encode()).hexdigest(), 16) % k == 0  # noqa: E731
    return [r for r, c in zip(rows, conv, strict=True) if keep(c)]


def prefix_fraction(
    reqs: Sequence[TraceRequest], block: int, before: Sequence[TraceRequest] = ()
) -> float:
    """Of every prompt token, the share in a prefix an earlier request had (one of `reqs`
    or of `before`, the run's earlier levels and rounds): what a cache that kept
    everything could restore."""
    seen = {r.hash_ids[: j + 1] for r in before for j in range(len(r.hash_ids))}
    hit = total = 0
    for r in reqs:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[: n + 1] in seen:
            n += 1
        seen.update(r.hash_ids[: j + 1] for j in range(len(r.hash_ids)))
        hit += min(n * block, r.tokens)
        total += r.tokens
    return hit / total if total else 0.0


def shared_fraction(reqs: Sequence[TraceRequest]) -> float:
    """Of every request's hash blocks, the share an earlier request already had."""
    seen: set[int] = set()
    shared = total = 0
    for r in reqs:
        for h in r.hash_ids:
            shared += h in seen
            total += 1
            seen.add(h)
    return shared / total if total else 0.0


def vllm_times(metrics: str) -> dict[str, float]:
    """The sums and counts of vLLM's request-time histograms in a /metrics text."""
    got: dict[str, float] = {}
    for line in metrics.splitlines():
        for name in VLLM_TIMES:
            for part in ("_sum", "_count"):
                if line.startswith(f"vllm:{name}{part}"):
                    key = name + part
                    got[key] = got.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return got


def _mean(before: dict, after: dict, name: str) -> float | None:
    n = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    return (after.get(name + "_sum", 0) - before.get(name + "_sum", 0)) / n if n > 0 else None


def breakdown(
    before: Sequence[dict], after: Sequence[dict], timeline: Sequence[dict], requests: int
) -> dict:
    """Mean seconds a request of one level: vLLM's queue wait, prefill and TTFT (its
    engines' histograms, before/after the level), and from the connector's timeline rows
    inside the level: the lookup's wait, the loads, the saves the steps waited for, the
    sets behind them, the blocks kept for the sets; pages saved and skipped."""
    sum_b, sum_a = _merge(before), _merge(after)
    out: dict = {
        "queue_s": _mean(sum_b, sum_a, "request_queue_time_seconds"),
        "prefill_s": _mean(sum_b, sum_a, "request_prefill_time_seconds"),
        "ttft_s": _mean(sum_b, sum_a, "time_to_first_token_seconds"),
    }
    per = max(1, requests)
    rows = {
        "lookup_s": ("request", "lookup_s"),
        "load_s": ("load", "load_s"),
        "save_wait_s": ("save", "save_s"),
        "set_s": ("set", "set_s"),
        "hold_s": ("hold", "hold_s"),
    }
    if timeline:
        for key, (kind, field) in rows.items():
            out[key] = sum(r.get(field, 0.0) for r in timeline if r["kind"] == kind) / per
        saves = [r for r in timeline if r["kind"] == "save"]
        out["pages_saved"] = sum(r["save_pages"] - r["skipped"] for r in saves)
        out["pages_skipped"] = sum(r["skipped"] for r in saves)
        out["late_steps"] = sum(r.get("late_steps", 0) for r in timeline if r["kind"] == "request")
    return out


def _merge(texts: Sequence[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in texts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def within(rows: Sequence[dict], start: float, end: float) -> list[dict]:
    """Timeline rows stamped inside [start, end]."""
    return [r for r in rows if start <= r["t"] <= end]


# the targets on this shape, the sidecar at the product's defaults ("defaults")
TARGET_P50_VS_LMCACHE = 0.8
TARGET_P99 = 1.0  # vs LMCache's and vs the engines alone's
TARGET_FILE_TIER_P99 = 1.05  # the file tier's cost: defaults over no file tier ("shared")


def targets(rows: Sequence[dict], policy: str, ttfts: dict | None = None) -> list[dict]:
    """The trace shape's targets at every level of `policy` in `rows` (one fleet size):
    ratio, limit, met (None where an arm is missing) and, with `ttfts` ({(arm, policy,
    level): {request: TTFT}}), each TTFT ratio's paired 95% interval."""
    at = {(r["arm"], r["users_per_engine"]): r for r in rows if r["policy"] == policy}
    out = []
    for level in sorted({lvl for _, lvl in at}):
        for other, key, limit in (
            ("lmcache", "ttft_p50_s", TARGET_P50_VS_LMCACHE),
            ("lmcache", "ttft_p99_s", TARGET_P99),
            ("none", "ttft_p99_s", TARGET_P99),
            ("lmcache", "req_s", 1.0),
            ("shared", "ttft_p99_s", TARGET_FILE_TIER_P99),
        ):
            out.append(_target(at, (policy, level), other, key, limit, ttfts or {}))
    return out


def _target(at: dict, where: tuple, other: str, key: str, limit: float, ttfts: dict) -> dict:
    """defaults' `key` over `other`'s at (policy, level) `where`; req/s must be above."""
    from loadtest.serving import lib as sl

    policy, level = where
    mine, theirs = at.get(("defaults", level)), at.get((other, level))
    ratio = lib.ratio(mine and mine[key], theirs and theirs[key])
    above = key == "req_s"
    met = None if ratio is None else (ratio >= limit if above else ratio <= limit)
    q = {"ttft_p50_s": 50, "ttft_p99_s": 99}.get(key)
    span = None
    if q is not None:
        a = ttfts.get(("defaults", policy, level), {})
        span = sl.interval(a, ttfts.get((other, policy, level), {}), q)
    name = f"defaults {key} / {other}'s at {level} users/engine"
    return {"target": name, "ratio": ratio, "limit": limit, "met": met, "interval": span}


def best_case(rows: Sequence[dict], policy: str) -> list[str]:
    """A line a level: the slice's prompt tokens, the tokens each arm computed (vLLM's
    `local_compute`) and those a cache that kept every earlier prefix would compute
    (`trace_prefix`), over LMCache's. Where TTFT follows the computed tokens (a closed loop
    of users on a busy fleet), no cache's p50 falls far below that ratio of LMCache's."""
    at: dict[int, dict[str, list[dict]]] = {}
    for r in rows:
        if r["policy"] == policy and r.get("trace_prefix") is not None:
            at.setdefault(r["users_per_engine"], {}).setdefault(r["arm"], []).append(r)
    out = []
    for level, arms in sorted(at.items()):
        rounds = next(iter(arms.values()))  # every arm ran the same requests
        total = sum(sum(r["vllm_tokens"].values()) for r in rounds)
        best = sum((1 - r["trace_prefix"]) * sum(r["vllm_tokens"].values()) for r in rounds)
        computed = {a: sum(r["vllm_tokens"]["local_compute"] for r in g) for a, g in arms.items()}
        theirs = computed.get("lmcache")
        over = f"{best / theirs:.2f}x LMCache's" if theirs else "no lmcache arm"
        done = ", ".join(f"{a} {int(c):,}" for a, c in computed.items())
        out.append(
            f"{level} users/engine: {int(total):,} prompt tokens, "
            f"{1 - best / total:.0%} in an earlier prefix; computed: {done}; "
            f"a cache that kept everything: {int(best):,} ({over})"
        )
    return out


BREAKDOWN_HEAD = [
    "arm",
    "policy",
    "users/engine",
    "queue ms",
    "prefill ms",
    "TTFT ms",
    "lookup ms",
    "load ms",
    "save wait ms",
    "set ms",
    "blocks held ms",
    "pages saved",
    "skipped",
]


def breakdown_rows(rows: Sequence[dict]) -> list[tuple]:
    """The breakdown table's rows (mean ms a request; '-' where an arm has no connector)."""

    def ms(b: dict, k: str) -> str:
        return lib.fmt_ms(b[k] * 1e3) if b.get(k) is not None else "-"

    out = []
    for r in rows:
        b = r.get("breakdown") or {}
        out.append(
            (
                r["arm"],
                r["policy"],
                r["users_per_engine"],
                *(ms(b, k) for k in ("queue_s", "prefill_s", "ttft_s", "lookup_s", "load_s")),
                *(ms(b, k) for k in ("save_wait_s", "set_s", "hold_s")),
                b.get("pages_saved", "-"),
                b.get("pages_skipped", "-"),
            )
        )
    return out
