"""The arithmetic and the proofs of `make bench-engines` (loadtest/engines/bench.py), kept
free of vLLM and torch so the project's own tests check them.

    restore proof:   greedy tokens == the cold run's
                     num_cached_tokens == what the state must give (vLLM's own blocks, plus
                       every token but the last where a connector loads the last block)
                     sidecar counters (when the arm has them): hits and bytes_out moved by
                       exactly the blocks loaded past vLLM's own, no misses
    restore target:  restored - in-engine hit <= bytes / (0.8 x memcpy GB/s) + 5 ms
"""

from __future__ import annotations

import json
import os
import random
import statistics
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

TARGET_COPY_FRACTION = 0.8  # a restore may run at 0.8x a one-thread memcpy
TARGET_FIXED_MS = 5.0  # ... plus 5 ms for the round trips and the step
TARGET_STORE_ON_MISS = 1.05  # connector / no connector, cold TTFT and throughput
TARGET_HIT_OVERHEAD = 1.03  # in-engine hit with the connector / without
TARGET_SHARE_TOLERANCE = 0.10  # measured block hit rate vs `sidecar plan`, relative


def summary(xs: Sequence[float]) -> dict:
    """Median and range of one figure's runs (empty: None values)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": list(xs)}


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = max(0, min(len(xs) - 1, -(-len(xs) * q // 100) - 1))
    return xs[int(k)]


def restore_limit_ms(nbytes: int, memcpy_s: float) -> float:
    """The restore target: bytes / (0.8 x memcpy) + 5 ms, with memcpy's time for the bytes."""
    return memcpy_s / TARGET_COPY_FRACTION * 1e3 + TARGET_FIXED_MS


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else None


def kv_page_bytes(
    layers: int, kv_heads: int, head_dim: int, block: int, dtype_bytes: int = 4
) -> int:
    """One KV block of every layer, K and V: the sidecar's page for a vLLM engine."""
    return layers * 2 * kv_heads * head_dim * block * dtype_bytes


def blocks_for(tokens: int, block: int) -> int:
    """KV blocks that hold `tokens` tokens (a partial block counts)."""
    return -(-tokens // block)


def local_hit(prompt: int, block: int) -> int:
    """Tokens vLLM's own prefix cache gives a prompt it computed: whole blocks, never the
    last token."""
    return (prompt - 1) // block * block


def expected_cached(arm: str, prompt: int, block: int, local: int, chunk: int = 256) -> int:
    """`num_cached_tokens` of a prompt the arm's cache holds whole. `local`: what vLLM's own
    cache gives in this state (0 after a reset).
      none:    vLLM's own cache only.
      sidecar: every token but the last (the connector loads the block holding it, whole
               or as the prompt's tail).
      lmcache: chunk-aligned hits (256 tokens); a whole-prompt hit gives all but the last."""
    if arm.startswith("sidecar"):
        return prompt - 1
    if arm == "lmcache":
        got = prompt // chunk * chunk
        return max(local, prompt - 1 if got == prompt else got)
    return local


@dataclass
class Counters:
    """A sidecar's get counters (sum over namespaces) at one moment."""

    hits: int = 0
    misses: int = 0
    bytes_out: int = 0

    @classmethod
    def of(cls, stats: dict) -> Counters:
        c = cls()
        for ns in stats.get("namespaces", {}).values():
            c.hits += ns.get("hits", 0)
            c.misses += ns.get("misses", 0)
            c.bytes_out += ns.get("bytes_out", 0)
        return c

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.hits - other.hits, self.misses - other.misses, self.bytes_out - other.bytes_out
        )


@dataclass
class Proof:
    ok: bool
    why: list[str] = field(default_factory=list)
    blocks: int = 0  # blocks the connector loaded (counter-proven when counters exist)
    nbytes: int = 0


def prove(
    tokens: list[int],
    cold_tokens: list[int],
    cached: int,
    want_cached: int,
    local: int,
    block: int,
    page_bytes: int,
    delta: Counters | None,
) -> Proof:
    """Does this run count? `local`: vLLM's own tokens in this state (0 after a reset);
    `delta`: the sidecar's counters across the run (None: the arm has none, and the proof
    rests on num_cached_tokens and the tokens)."""
    why = []
    if tokens != cold_tokens:
        why.append("greedy tokens differ from the cold run's")
    if cached != want_cached:
        why.append(f"num_cached_tokens {cached}, want {want_cached}")
    blocks = max(blocks_for(cached, block) - local // block, 0)
    if delta is not None:
        if delta.hits != blocks:
            why.append(f"sidecar hits moved by {delta.hits}, want {blocks}")
        if delta.misses:
            why.append(f"sidecar misses moved by {delta.misses}")
        if delta.bytes_out != blocks * page_bytes:
            why.append(f"sidecar bytes_out moved by {delta.bytes_out}, want {blocks * page_bytes}")
    return Proof(not why, why, blocks, blocks * page_bytes)


def prompt(seed: int, n: int, vocab: int = 1024) -> list[int]:
    """A deterministic random prompt (token ids 2..vocab-1; 0/1 are BOS/EOS)."""
    r = random.Random(seed)
    return [r.randrange(2, vocab) for _ in range(n)]


def block_tokens(hash_id: int, block: int, vocab: int = 1024) -> list[int]:
    """The tokens standing for one trace block: the same id, the same tokens, so requests
    that share a trace prefix share vLLM's block hashes exactly as far."""
    return prompt(1_000_003 * (hash_id + 1), block, vocab)


def trace_prompt(hash_ids: Sequence[int], block: int) -> list[int]:
    """A trace request scaled to fit: each 512-token trace block becomes one KV block."""
    return [t for h in hash_ids for t in block_tokens(h, block)]


def conversations(requests: Sequence[dict]) -> list[int]:
    """Conversation id of each request: the earliest request it shares its longest common
    prefix (2 blocks or more: block 0 is the same in every request) with."""
    owner: dict[tuple, int] = {}
    conv = list(range(len(requests)))
    for i, r in enumerate(requests):
        ids = tuple(r["hash_ids"])
        for k in range(len(ids), 1, -1):
            j = owner.get(ids[:k])
            if j is not None:
                conv[i] = conv[j]
                break
        for k in range(2, len(ids) + 1):
            owner.setdefault(ids[:k], i)
    return conv


def multi_turn_slice(
    requests: Sequence[dict], n_conversations: int, min_turns: int = 2, max_blocks: int = 10**9
) -> list[int]:
    """Indices, in trace order, of every request of the first `n_conversations`
    conversations with at least `min_turns` turns (none longer than `max_blocks`)."""
    conv = conversations(requests)
    turns: dict[int, list[int]] = {}
    for i, c in enumerate(conv):
        turns.setdefault(c, []).append(i)
    chosen = []
    for c in sorted(turns):
        idx = turns[c]
        if len(idx) >= min_turns and all(len(requests[i]["hash_ids"]) <= max_blocks for i in idx):
            chosen.append(c)
            if len(chosen) == n_conversations:
                break
    keep = set(chosen)
    return [i for i, c in enumerate(conv) if c in keep]


def within(measured: float, expected: float, tolerance: float = TARGET_SHARE_TOLERANCE) -> bool:
    """Relative agreement (both 0 agree)."""
    if expected == 0:
        return measured == 0
    return abs(measured - expected) / expected <= tolerance


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Round-by-round ratios of two arms measured in the same rounds."""
    return [x / y for x, y in zip(a, b, strict=True) if x is not None and y]


def jsonl(records: Iterable[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def fmt_range(s: dict, scale: float = 1e3) -> str:
    """`median (min-max)` of a summary in ms."""
    if s.get("median") is None:
        return "-"
    return f"{fmt_ms(s['median'] * scale)} ({fmt_ms(s['min'] * scale)}-{fmt_ms(s['max'] * scale)})"


def table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table."""
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def proof_dict(p: Proof) -> dict:
    return asdict(p)


@contextmanager
def sidecar_env(pairs: list[str]):
    """KEY=VALUE settings for the sidecar process only (e.g. a glibc tunable): set while it
    starts, then put back, so engines started later do not inherit them."""
    saved = {}
    for kv in pairs:
        key, _, value = kv.partition("=")
        saved[key] = os.environ.get(key)
        os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
