"""From the rounds of `make bench-engines` to its figures (one record each) and tables.

A run (one arm, one prompt length, one round) holds each state's TTFT, num_cached_tokens
and proof, and the memcpy of the restored bytes timed in that round. Only kept rounds (past
the warm-up) with proven states enter a figure; paired figures (overhead, ratios) pair the
states of one arm in one round, or two arms in one round.
"""

from __future__ import annotations

from collections.abc import Iterable

from loadtest.engines import lib as lib


def _kept(runs: list[dict], arm: str, length: int | None = None, batch: bool = False) -> list[dict]:
    return [
        r
        for r in runs
        if r["kept"]
        and r["arm"] == arm
        and bool(r.get("batch")) == batch
        and (length is None or r.get("length") == length)
    ]


def _ttft(run: dict, state: str) -> float | None:
    s = run["states"].get(state)
    return s["ttft"] if s is not None and s["proof"]["ok"] else None


def _loads(runs: list[dict]) -> dict:
    return lib.summary([r["load"] for r in runs])


def three_states(runs: list[dict], arms: list[str], lengths: list[int]) -> Iterable[dict]:
    for arm in arms:
        for n in lengths:
            mine = _kept(runs, arm, n)
            for state in ("cold", "hit", "restored", "cross"):
                got = [r["states"][state] for r in mine if state in r["states"]]
                if not got:
                    continue
                bad = [w for g in got for w in g["proof"]["why"]]
                yield {
                    "figure": "three_states",
                    "arm": arm,
                    "length": n,
                    "state": state,
                    "ttft_s": lib.summary([g["ttft"] for g in got if g["proof"]["ok"]]),
                    "cached": lib.summary([g["cached"] for g in got])["median"],
                    "bytes_loaded": lib.summary([g["proof"]["nbytes"] for g in got])["median"],
                    "proven": sum(g["proof"]["ok"] for g in got),
                    "of": len(got),
                    "unproven_because": sorted(set(bad)),
                    "load": _loads(mine),
                }


def _memcpy(runs: list[dict], rnd: int, n: int) -> tuple | None:
    """(memcpy s, its bytes, memmove in the layout's runs s) timed in that round."""
    for r in runs:
        if r["round"] == rnd and r.get("length") == n and r.get("memcpy_s"):
            return (
                r["memcpy_s"],
                r["states"]["restored"]["proof"]["nbytes"],
                r.get("memmove_runs_s"),
            )
    return None


def restore(runs: list[dict], arms: list[str], lengths: list[int]) -> Iterable[dict]:
    """restored - hit, paired by round; the limit from the memcpy of the same bytes, scaled
    to the bytes the restore moved beyond the hit's."""
    for arm in arms:
        if arm == "none":
            continue
        for n in lengths:
            over, nbytes, copy, limit, runs64 = [], [], [], [], []
            mine = _kept(runs, arm, n)
            for r in mine:
                h, x = _ttft(r, "hit"), _ttft(r, "restored")
                mc = _memcpy(runs, r["round"], n)
                if h is None or x is None or mc is None:
                    continue
                b = (
                    r["states"]["restored"]["proof"]["nbytes"]
                    - r["states"]["hit"]["proof"]["nbytes"]
                )
                copy_s = mc[0] * b / mc[1] if mc[1] else 0.0
                over.append(x - h)
                nbytes.append(b)
                copy.append(copy_s)
                limit.append(lib.restore_limit_ms(b, copy_s) / 1e3)
                if mc[2] and mc[1]:
                    runs64.append(mc[2] * b / mc[1])
            o, b, c, lim = (lib.summary(v) for v in (over, nbytes, copy, limit))
            yield {
                "figure": "restore",
                "arm": arm,
                "length": n,
                "overhead_s": o,
                "bytes": b["median"],
                "gbps": lib.gbps(b["median"], o["median"]) if b["median"] else None,
                "memcpy_s": c,
                "memcpy_gbps": lib.gbps(b["median"], c["median"]) if b["median"] else None,
                "memcpy_in_runs_s": lib.summary(runs64),
                "limit_s": lim,
                "met": o["median"] is not None and o["median"] <= lim["median"],
                "pairs": len(over),
                "load": _loads(mine),
            }


def _paired(runs: list[dict], a: str, b: str, n: int, state_a: str, state_b: str) -> list[float]:
    by_round = {r["round"]: r for r in _kept(runs, b, n)}
    out = []
    for r in _kept(runs, a, n):
        other = by_round.get(r["round"])
        if other is None:
            continue
        x, y = _ttft(r, state_a), _ttft(other, state_b)
        if x is not None and y:
            out.append(x / y)
    return out


def issue33(runs: list[dict], arms: list[str], lengths: list[int]) -> Iterable[dict]:
    for arm in (a for a in arms if a.startswith("sidecar")):
        for n in lengths:
            if "none" in arms:
                pr = _paired(runs, arm, "none", n, "hit", "hit")
                med = _med_ratio(runs, arm, "none", n, "hit")
                yield {
                    "figure": "issue33",
                    "arm": arm,
                    "what": "in-engine hit / no connector",
                    "length": n,
                    "ratio_of_medians": med,
                    "paired": lib.summary(pr),
                    "target": lib.TARGET_HIT_OVERHEAD,
                    "met": med is not None and med <= lib.TARGET_HIT_OVERHEAD,
                }
            if "lmcache" in arms:
                for state in ("restored", "cross"):
                    pr = _paired(runs, arm, "lmcache", n, state, state)
                    med = _med_ratio(runs, arm, "lmcache", n, state)
                    yield {
                        "figure": "issue33",
                        "arm": arm,
                        "what": f"{state} / LMCache {state}",
                        "length": n,
                        "ratio_of_medians": med,
                        "paired": lib.summary(pr),
                        "target": 1.0,
                        "met": med is not None and med <= 1.0,
                    }


def _med_ratio(runs, a, b, n, state) -> float | None:
    x = lib.summary([_ttft(r, state) for r in _kept(runs, a, n)])["median"]
    y = lib.summary([_ttft(r, state) for r in _kept(runs, b, n)])["median"]
    return lib.ratio(x, y)


def store_on_miss(runs: list[dict], arms: list[str], lengths: list[int]) -> Iterable[dict]:
    if "none" not in arms:
        return
    for arm in arms:
        if arm == "none":
            continue
        for n in lengths:
            pr = _paired(runs, arm, "none", n, "cold", "cold")
            med = _med_ratio(runs, arm, "none", n, "cold")
            yield {
                "figure": "store_on_miss",
                "what": "cold TTFT",
                "arm": arm,
                "length": n,
                "ratio_of_medians": med,
                "paired": lib.summary(pr),
                "target": lib.TARGET_STORE_ON_MISS,
                "met": med is not None and med <= lib.TARGET_STORE_ON_MISS,
                "load": _loads(_kept(runs, arm, n)),
            }
        mine, base = (
            _kept(runs, arm, batch=True),
            {r["round"]: r for r in _kept(runs, "none", batch=True)},
        )
        if not mine:
            continue
        pr = [r["seconds"] / base[r["round"]]["seconds"] for r in mine if r["round"] in base]
        tps = lib.summary([r["tokens"] / r["seconds"] for r in mine])
        tps0 = lib.summary([r["tokens"] / r["seconds"] for r in base.values()])
        med = lib.ratio(tps0["median"], tps["median"])
        yield {
            "figure": "store_on_miss",
            "what": "batch time (unique prompts)",
            "arm": arm,
            "tokens_per_s": tps,
            "none_tokens_per_s": tps0,
            "ratio_of_medians": med,
            "paired": lib.summary(pr),
            "target": lib.TARGET_STORE_ON_MISS,
            "cached_tokens": sum(sum(r["cached"]) for r in mine),
            "met": med is not None and med <= lib.TARGET_STORE_ON_MISS,
            "load": _loads(mine),
        }


def restore_figures(
    runs: list[dict], arms: list[str], lengths: list[int], page_bytes: int
) -> list[dict]:
    recs = list(three_states(runs, arms, lengths)) + list(restore(runs, arms, lengths))
    recs += list(issue33(runs, arms, lengths)) + list(store_on_miss(runs, arms, lengths))
    for r in recs:
        r["page_bytes"] = page_bytes
    return recs


# -- tables --------------------------------------------------------------------------
def _s(x: dict | None) -> str:
    return lib.fmt_range(x) if x else "-"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _load(rec: dict) -> str:
    ld = rec.get("load") or {}
    return "-" if ld.get("median") is None else f"{ld['min']:.1f}-{ld['max']:.1f}"


def tables(records: list[dict]) -> str:
    parts = []
    three = [r for r in records if r["figure"] == "three_states"]
    if three:
        rows = [
            (
                r["arm"],
                r["length"],
                r["state"],
                _s(r["ttft_s"]),
                r["cached"],
                f"{(r['bytes_loaded'] or 0) / 2**20:.1f}",
                f"{r['proven']}/{r['of']}",
                _load(r),
            )
            for r in three
        ]
        parts.append(
            "TTFT by state, ms: median (range) over proven rounds\n\n"
            + lib.table(
                ["arm", "tokens", "state", "TTFT ms", "cached", "MiB loaded", "proven", "load"],
                rows,
            )
        )
    rest = [r for r in records if r["figure"] == "restore"]
    if rest:
        rows = [
            (
                r["arm"],
                r["length"],
                _s(r["overhead_s"]),
                f"{(r['bytes'] or 0) / 2**20:.1f}",
                "-" if r["gbps"] is None else f"{r['gbps']:.1f}",
                _s(r["memcpy_s"]),
                "-" if r["memcpy_gbps"] is None else f"{r['memcpy_gbps']:.1f}",
                _s(r.get("memcpy_in_runs_s")),
                _s(r["limit_s"]),
                "met" if r["met"] else "NOT met",
                _load(r),
            )
            for r in rest
        ]
        parts.append(
            "Restore overhead (restored - in-engine hit), paired by round; memcpy: one thread, "
            "the same bytes (the faster of glibc memmove and a torch copy); in runs: memmove of "
            "one layer's block at a time\n\n"
            + lib.table(
                [
                    "arm",
                    "tokens",
                    "overhead ms",
                    "MiB",
                    "GB/s",
                    "memcpy ms",
                    "memcpy GB/s",
                    "memcpy in runs ms",
                    "limit ms",
                    "target",
                    "load",
                ],
                rows,
            )
        )
    for fig, title in (
        ("issue33", "Issue 33 targets"),
        ("store_on_miss", "Store on miss (0% hits)"),
    ):
        recs = [r for r in records if r["figure"] == fig]
        if recs:
            rows = [
                (
                    r.get("arm", "sidecar"),
                    r["what"],
                    r.get("length", "-"),
                    _r(r["ratio_of_medians"]),
                    _paired_text(r["paired"]),
                    f"<= {r['target']:.2f}x",
                    "met" if r["met"] else "NOT met",
                )
                for r in recs
            ]
            parts.append(
                title
                + "\n\n"
                + lib.table(
                    ["arm", "figure", "tokens", "ratio of medians", "paired rounds", "target", ""],
                    rows,
                )
            )
    share = [r for r in records if r["figure"] == "sharing"]
    if share:
        from loadtest.engines.share import share_table

        parts.append(share_table(share))
    lm = [r for r in records if r["figure"] == "lmcache"]
    for r in lm:
        parts.append(f"LMCache did not run: {r['error'][-600:]}")
    return "\n\n".join(parts) + "\n"


def _paired_text(s: dict) -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"
