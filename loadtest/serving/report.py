"""Tables, targets and TTFT CDF plots of `make bench-serve`:

    python -m loadtest.serving.report build/bench-serve [--no-plot]

Reads DIR/bench-serve.jsonl and DIR/requests-*.jsonl; writes DIR/bench-serve.md and
DIR/ttft-cdf-<arm>.png (one line per fleet size, policy and level; warm-up dropped).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loadtest.engines import lib as lib
from loadtest.serving import lib as sl
from loadtest.serving import trace_replay as bt

SIDECAR_ARMS = ("shared", "defaults", "split")
HEAD = [
    "engines",
    "arm",
    "policy",
    "users/engine",
    "requests",
    "errors",
    "TTFT p50 ms",
    "p90",
    "p99",
    "e2e p50 ms",
    "e2e p99",
    "req/s",
    "out tok/s",
    "own cache tok",
    "beneath tok",
    "computed tok",
    "sidecar pages hit",
    "missed at load",
    "agree",
    "cache CPU s",
    "cache RSS MiB",
    "load",
]


def _ms(x) -> str:
    return lib.fmt_ms(x * 1e3) if x is not None else "-"


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        v, sc = r["vllm_tokens"], r["sidecar"]
        out.append(
            (
                r["engines"],
                r["arm"],
                r["policy"],
                f"{r['users_per_engine']}" + (f" r{r['round']}" if r.get("round") else ""),
                r["requests"],
                r["errors"],
                _ms(r["ttft_p50_s"]),
                _ms(r["ttft_p90_s"]),
                _ms(r["ttft_p99_s"]),
                _ms(r["e2e_p50_s"]),
                _ms(r["e2e_p99_s"]),
                f"{r['req_s']:.2f}" if r["req_s"] else "-",
                f"{r['out_tok_s']:.1f}" if r["out_tok_s"] else "-",
                f"{v['local_cache_hit']:,.0f}",
                f"{v['external_kv_transfer']:,.0f}",
                f"{v['local_compute']:,.0f}",
                sc["hits"] if r["arm"] in SIDECAR_ARMS else "-",
                sc["misses"] if r["arm"] in SIDECAR_ARMS else "-",
                {None: "-", True: "yes", False: "NO"}[sc["agree"]],
                f"{r['cache_cpu_s']:.1f}",
                f"{r['cache_rss'] / 2**20:,.0f}" if r["cache_rss"] else "-",
                f"{r['load']:.1f}",
            )
        )
    return lib.table(HEAD, out)


def report(outdir: Path, plot: bool = True) -> str:
    rows = [
        json.loads(x) for x in (outdir / "bench-serve.jsonl").read_text().splitlines() if x.strip()
    ]
    every = rows
    rows = [r for r in every if r.get("shape", "conversations") == "conversations"]
    trace = [r for r in every if r.get("shape") == "trace"]
    parts = [
        "Served: vllm serve fleets under Locust (TTFT at the first streamed token)\n",
        table(rows),
    ]
    for n in sorted({r["engines"] for r in rows}):
        mine, ttfts = pooled(outdir, [r for r in rows if r["engines"] == n])
        for policy in sorted({r["policy"] for r in mine}):
            ts = sl.targets(mine, policy, ttfts=ttfts)
            parts.append(f"\nTargets, {n} engines, {policy}:\n" + sl.targets_text(ts))
    if trace:
        parts.append(trace_report(outdir, trace))
    errors = sum(r["errors"] for r in every)
    parts.append(f"\nErrors in all: {errors} (must be 0)")
    text = "\n".join(parts) + "\n"
    (outdir / "bench-serve.md").write_text(text)
    if plot:
        cdf_plots(outdir, every)
    return text


def trace_report(outdir: Path, rows: list[dict]) -> str:
    """The trace shape: its table, where the time went (mean a request) and its targets."""
    parts = ["\nThe trace's requests in order (shape `trace`)\n", table(rows)]
    parts.append("\nWhere the time went, mean a request (trace.breakdown)\n")
    parts.append(lib.table(bt.BREAKDOWN_HEAD, bt.breakdown_rows(rows)))
    for n in sorted({r["engines"] for r in rows}):
        every = [r for r in rows if r["engines"] == n]
        mine, ttfts = pooled(outdir, every)
        for policy in sorted({r["policy"] for r in mine}):
            ts = bt.targets(mine, policy, ttfts)
            parts.append(f"\nTargets, trace, {n} engines, {policy}:\n" + sl.targets_text(ts))
            best = bt.best_case(every, policy)
            if best:
                parts.append("Tokens computed, and at best (trace.best_case):\n" + "\n".join(best))
    return "\n".join(parts)


def pooled(outdir: Path, rows: list[dict]) -> tuple[list[dict], dict]:
    """One fleet size's rows, a level run in several rounds (`--rounds`) made one: TTFT
    percentiles over every round's kept requests, req/s the rounds' mean, tokens summed;
    and each (arm, policy, level)'s kept TTFTs by (round, request), paired across arms."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["arm"], r["policy"], r["users_per_engine"]), []).append(r)
    merged, ttfts = [], {}
    for key, group in cells.items():
        kept = {(g.get("round", 0), k): t for g in group for k, t in kept_ttfts(outdir, g).items()}
        ttfts[key] = kept
        if len(group) == 1:
            merged.append(group[0])
            continue
        rates = [g["req_s"] for g in group if g["req_s"]]
        tokens = {k: sum(g["vllm_tokens"][k] for g in group) for k in group[0]["vllm_tokens"]}
        merged.append(
            {
                **group[0],
                **{f"ttft_p{q}_s": lib.percentile(list(kept.values()), q) for q in (50, 90, 99)},
                "req_s": sum(rates) / len(rates) if rates else None,
                "vllm_tokens": tokens,
                "rounds": len(group),
            }
        )
    return merged, ttfts


def kept_ttfts(outdir: Path, row: dict) -> dict:
    """A row's requests' TTFTs (s) by (user, n) (the trace shape: by trace request), each
    user's warm-up (`n` below the row's `warmup`) dropped, as are failed requests."""
    trace = row.get("shape") == "trace"
    tag = f"{row['arm']}-{row['engines']}-{row['policy']}-{row['users_per_engine']}"
    tag += f"-r{row['round']}" if row.get("round") else ""
    path = outdir / f"requests-{'trace-' if trace else ''}{tag}.jsonl"
    if not path.exists():
        return {}
    recs = (json.loads(x) for x in path.read_text().splitlines())
    warmup = row.get("warmup", 1)
    return {
        (x["cid"] if trace else (x["user"], x["n"])): x["ttft"]
        for x in recs
        if x["n"] >= warmup and x.get("ttft") is not None and not x.get("error")
    }


def cdf_plots(outdir: Path, rows: list[dict]) -> None:
    """One figure per arm: the kept requests' TTFT CDF for each fleet size, policy, level."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return
    for arm in sorted({r["arm"] for r in rows}):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in (r for r in rows if r["arm"] == arm):
            ttft = sorted(kept_ttfts(outdir, r).values())
            if ttft:
                ax.plot(
                    [t * 1e3 for t in ttft],
                    [(i + 1) / len(ttft) for i in range(len(ttft))],
                    label=f"{r.get('shape', 'conversations')}, {r['engines']} eng, "
                    f"{r['policy']}, {r['users_per_engine']} u/eng",
                )
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF: {arm}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(outdir / f"ttft-cdf-{arm}.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]), plot="--no-plot" not in sys.argv))
