"""The arithmetic of `make bench-serve` (issue 44), free of vLLM and Locust so the core
suite checks it: trace -> conversations, the `vllm serve` command from the manifest, and the
per-level report with its targets.

    conversation: requests of the trace sharing a prefix of 2+ blocks
                  (lib.conversations), 2+ turns, in trace order
    turn k:       prompt_k = prompt_{k-1} + answer_{k-1} + new user tokens; the new tokens'
                  count is the trace's growth scaled down (input_k - input_{k-1} - output_{k-1},
                  over `scale`, at least 1), their ids a function of (conversation, turn) only
    targets:      at 4 users an engine, the shared sidecar's TTFT p50 <= 0.8x LMCache's and
                  <= 0.5x no connector's; req/s >= LMCache's; TTFT p99 <= no connector's at
                  every level
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.engines import lib as lib

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "engine-vllm.yaml"
TARGET_P50_VS_LMCACHE = 0.8
TARGET_P50_VS_NONE = 0.5
TARGET_LEVEL = 4


@dataclass(frozen=True)
class Turn:
    new_tokens: int  # user tokens appended after the previous prompt and answer
    max_tokens: int  # the answer's length


@dataclass(frozen=True)
class Conversation:
    cid: int  # the trace index of its first request
    turns: tuple[Turn, ...]


def scaled(n: int, scale: int) -> int:
    return max(1, -(-n // scale))


def conversations(
    rows: Sequence[dict], scale: int = 16, max_prompt: int = 4096, min_turns: int = 2
) -> list[Conversation]:
    """The trace's multi-turn conversations, turns scaled by `scale` (512-token trace
    blocks become 32 tokens at 16). A conversation is cut where a turn's prompt plus answer
    would pass `max_prompt` tokens; those left with fewer than `min_turns` turns are dropped."""
    conv = lib.conversations(rows)
    members: dict[int, list[int]] = {}
    for i, c in enumerate(conv):
        members.setdefault(c, []).append(i)
    out = []
    for c in sorted(members):
        turns, length, prev_in, prev_out = [], 0, 0, 0
        for i in members[c]:
            grown = (
                scaled(rows[i]["input_length"], scale)
                - scaled(prev_in, scale)
                - scaled(prev_out, scale)
                if turns
                else scaled(rows[i]["input_length"], scale)
            )
            turn = Turn(max(1, grown), scaled(rows[i]["output_length"], scale))
            if length + turn.new_tokens + turn.max_tokens > max_prompt:
                break
            length += turn.new_tokens + turn.max_tokens
            turns.append(turn)
            prev_in, prev_out = rows[i]["input_length"], rows[i]["output_length"]
        if len(turns) >= min_turns:
            out.append(Conversation(c, tuple(turns)))
    return out


def user_tokens(cid: int, turn: int, n: int, vocab: int = 1024) -> list[int]:
    """The new user tokens of one turn: ids 2..vocab-1 (0/1 are BOS/EOS), seeded by sha256
    of (conversation, turn) so every arm and run sends the same ones."""
    seed = int.from_bytes(hashlib.sha256(f"{cid}:{turn}".encode()).digest()[:8], "big")
    r = random.Random(seed)
    return [r.randrange(2, vocab) for _ in range(n)]


def next_prompt(
    prev_prompt: list[int], prev_answer: list[int], conv: Conversation, k: int
) -> list[int]:
    """Turn k's prompt: turn k-1's prompt and answer, then turn k's new user tokens."""
    new = user_tokens(conv.cid, k, conv.turns[k].new_tokens)
    return (prev_prompt + prev_answer + new) if k else new


def assign(convs: Sequence[Conversation], users: int, offset: int = 0) -> list[list[Conversation]]:
    """User u's conversations: offset+u, offset+u+users, ... (a fixed set per level, the
    same in every arm)."""
    pool = list(convs[offset:])
    return [pool[u::users] for u in range(users)]


def per_user(requests: int, users: int, warmup: int) -> int:
    """Requests each user plays: its `warmup` and its share of `requests` (rounded up)."""
    if users < 1 or requests < 0 or warmup < 0:
        raise ValueError(f"no plan for {requests} requests, {users} users, warm-up {warmup}")
    return warmup + -(-requests // users)


def route(policy: str, seq: int, cid: int, engines: int) -> int:
    """Round-robin: `seq` (a user's request number plus the user's index: the same engine
    for the same request in every arm, users staggered); sticky: the conversation's sha256
    (never Python's hash()), so a conversation stays on one engine."""
    if policy == "rr":
        return seq % engines
    if policy == "sticky":
        return int.from_bytes(hashlib.sha256(str(cid).encode()).digest()[:4], "big") % engines
    raise ValueError(f"unknown policy {policy!r}")


def manifest_args(path: Path = MANIFEST) -> list[str]:
    """The `vllm serve` args of the engine manifest's vllm container (model first)."""
    import yaml

    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "Pod":
            for c in doc["spec"]["containers"]:
                if c["name"] == "vllm":
                    return list(c["args"])
    raise ValueError(f"no vllm container in {path}")


def serve_args(
    model: str,
    port: int,
    connector: dict | None,
    extra: Sequence[str] = (),
    manifest: Sequence[str] = (),
) -> list[str]:
    """`vllm serve` args: the manifest's flags (its model, host and port replaced; its
    --kv-transfer-config replaced by `connector`, or left out when None), then `extra`."""
    args = [model, "--host=127.0.0.1", f"--port={port}"]
    for a in (manifest or manifest_args())[1:]:
        name = a.split("=", 1)[0]
        if name in ("--host", "--port"):
            continue
        if name == "--kv-transfer-config":
            if connector is not None:
                args.append("--kv-transfer-config=" + json.dumps(connector))
            continue
        args.append(a)
    return args + list(extra)


def sidecar_connector(socket_url: str, manifest: Sequence[str] = ()) -> dict:
    """The manifest's --kv-transfer-config with the bench's sidecar socket."""
    for a in manifest or manifest_args():
        if a.startswith("--kv-transfer-config="):
            cfg = json.loads(a.split("=", 1)[1])
            cfg["kv_connector_extra_config"]["sidecar_url"] = socket_url
            return cfg
    raise ValueError("the manifest has no --kv-transfer-config")


def level_summary(recs: Sequence[dict], warmup: int) -> dict:
    """One level's figures from its request records: each user's first `warmup` (`n` below
    it) are dropped; req/s and tokens/s over the kept requests' span."""
    kept = [r for r in recs if r["n"] >= warmup]
    ok = [r for r in kept if not r.get("error")]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    e2e = [r["e2e"] for r in ok]
    span = (max(r["end"] for r in kept) - min(r["start"] for r in kept)) if kept else 0.0
    return {
        "requests": len(kept),
        "errors": len(kept) - len(ok),
        "ttft_p50_s": lib.percentile(ttft, 50),
        "ttft_p90_s": lib.percentile(ttft, 90),
        "ttft_p99_s": lib.percentile(ttft, 99),
        "e2e_p50_s": lib.percentile(e2e, 50),
        "e2e_p99_s": lib.percentile(e2e, 99),
        "req_s": len(ok) / span if span > 0 else None,
        "out_tok_s": sum(r["out_tokens"] for r in ok) / span if span > 0 else None,
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "cached_tokens": sum(r.get("cached_tokens") or 0 for r in ok),
    }


def counters_agree(sidecar_pages: int, external_tokens: int, loads: int, block: int) -> bool:
    """The pages the connectors asked the sidecar for (its get hits and misses) against
    vLLM's external_kv_transfer tokens: each load of e tokens reads ceil(e / block) pages (a
    partial last page is the prompt's tail), so pages x block - tokens lies in
    [0, block x loads). vLLM counts a load's tokens when it schedules it, so a page evicted
    between the lookup and the load (a get miss, the block recomputed) is in both."""
    gap = sidecar_pages * block - external_tokens
    return 0 <= gap < block * max(loads, 1) if sidecar_pages or external_tokens else True


def paired_ratio_interval(
    pairs: Sequence[tuple[float, float]], q: float, rounds: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """As `ratio_interval`, for two arms that served the same requests: (a, b) per request,
    the pairs resampled together, so the requests' own spread (a long cold prompt is slow in
    every arm) does not count as chance between the arms."""
    if not pairs:
        return None

    def draw(rnd: random.Random) -> tuple[list[float], list[float]]:
        pick = rnd.choices(pairs, k=len(pairs))
        return [a for a, _ in pick], [b for _, b in pick]

    return _bootstrap(draw, q, rounds, seed)


def interval(a: Sequence[float] | dict, b: Sequence[float] | dict, q: float):
    """The ratio's interval: paired where both are {request: TTFT} over the same requests,
    else the arms resampled apart."""
    if isinstance(a, dict) and isinstance(b, dict) and a and a.keys() == b.keys():
        return paired_ratio_interval([(a[k], b[k]) for k in sorted(a)], q)
    return ratio_interval(list(_values(a)), list(_values(b)), q)


def _values(x: Sequence[float] | dict) -> Sequence[float]:
    return list(x.values()) if isinstance(x, dict) else x


def ratio_interval(
    a: Sequence[float], b: Sequence[float], q: float, rounds: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """The 95% percentile-bootstrap interval of percentile(a, q) / percentile(b, q): each
    arm's requests resampled apart (the arms ran apart), `rounds` times, a fixed seed.

    A p99 of 100 requests is their slowest one or two: on two cores, which cold prefills
    happened to overlap. The interval says whether a ratio's distance from its limit is more
    than that chance."""
    if not a or not b:
        return None
    return _bootstrap(
        lambda rnd: (rnd.choices(a, k=len(a)), rnd.choices(b, k=len(b))), q, rounds, seed
    )


def _bootstrap(
    draw: Callable[[random.Random], tuple[list[float], list[float]]],
    q: float,
    rounds: int,
    seed: int,
) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of percentile(a, q) / percentile(b, q) over `rounds`
    resamples (a, b) = draw(rnd), one seeded generator for all."""
    rnd = random.Random(seed)
    got = []
    for _ in range(rounds):
        sa, sb = draw(rnd)
        pa, pb = lib.percentile(sa, q), lib.percentile(sb, q)
        if pa is not None and pb:
            got.append(pa / pb)
    got.sort()
    return got[int(0.025 * len(got))], got[min(len(got) - 1, int(0.975 * len(got)))]


def targets(
    rows: Sequence[dict],
    policy: str = "rr",
    level: int = TARGET_LEVEL,
    ttfts: dict | None = None,
) -> list[dict]:
    """The issue's targets from the report rows of one run: each with its ratio, limit and
    met (None where an arm or level is missing), and with `ttfts` ({(arm, policy, level):
    kept TTFTs, a list or {request: TTFT}}) the ratio's 95% interval for the TTFT targets."""
    at = {(r["arm"], r["policy"], r["users_per_engine"]): r for r in rows}
    shared, lm = (at.get((a, policy, level)) for a in ("shared", "lmcache"))
    ttfts = ttfts or {}

    def one(name: str, a: float | None, b: float | None, limit: float, above: bool = False) -> dict:
        ratio = lib.ratio(a, b)
        met = None if ratio is None else (ratio >= limit if above else ratio <= limit)
        return {"target": name, "ratio": ratio, "limit": limit, "met": met, "interval": None}

    def ttft(arm: str, lvl: int, q: int, limit: float) -> dict:
        """shared's TTFT percentile q over `arm`'s at `lvl`, with its interval."""
        mine, theirs, key = ("shared", policy, lvl), (arm, policy, lvl), f"ttft_p{q}_s"
        s, o = at.get(mine), at.get(theirs)
        who = "LMCache's" if arm == "lmcache" else "no connector's"
        t = one(
            f"shared p{q} TTFT / {who} at {lvl} users/engine", s and s[key], o and o[key], limit
        )
        t["interval"] = interval(ttfts.get(mine, []), ttfts.get(theirs, []), q)
        return t

    out = [
        ttft("lmcache", level, 50, TARGET_P50_VS_LMCACHE),
        ttft("none", level, 50, TARGET_P50_VS_NONE),
        one(
            f"shared req/s / LMCache's at {level} users/engine",
            shared and shared["req_s"],
            lm and lm["req_s"],
            1.0,
            above=True,
        ),
    ]
    for arm, pol, lvl in sorted(at):
        if arm == "shared" and pol == policy and ("none", pol, lvl) in at:
            out.append(ttft("none", lvl, 99, 1.0))
    return out


def targets_text(ts: Sequence[dict]) -> str:
    """A line a target: ratio, limit, verdict, and where an interval was drawn, it and
    whether it holds the limit (the verdict then is within this run's chance)."""
    lines = []
    for t in ts:
        state = "no figure" if t["met"] is None else "met" if t["met"] else "NOT met"
        r = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        line = f"- {t['target']}: {r} (limit {t['limit']}) {state}"
        if t.get("interval"):
            lo, hi = t["interval"]
            line += f"; 95% interval {lo:.2f}-{hi:.2f}"
            if lo <= t["limit"] <= hi:
                line += " (holds the limit: within chance)"
        lines.append(line)
    return "\n".join(lines)
