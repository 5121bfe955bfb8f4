"""The chart of `make bench-engines`: TTFT by state and prompt length, per arm, with the
memcpy floor (in-engine hit + a one-thread memcpy of the restored bytes) and the restore
target (hit + memcpy / 0.8 + 5 ms) drawn over the sidecar's restores.

    python -m loadtest.engines.chart DIR/bench-engines.jsonl DIR/bench-engines.png

Runs in the project's .venv (matplotlib); reads only the JSON lines.
"""

from __future__ import annotations

import json
import sys

STYLE = {"cold": "o-", "hit": "s-", "restored": "^-", "cross": "v--"}
COLOR = {
    "none": "tab:gray",
    "sidecar": "tab:blue",
    "sidecar+nt": "tab:green",
    "lmcache": "tab:orange",
}


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def series(recs: list[dict], arm: str, state: str) -> tuple[list[int], list[float]]:
    pts = sorted(
        (r["length"], r["ttft_s"]["median"] * 1e3)
        for r in recs
        if r["figure"] == "three_states"
        and r["arm"] == arm
        and r["state"] == state
        and r["ttft_s"]["median"] is not None
    )
    return [p[0] for p in pts], [p[1] for p in pts]


def floors(recs: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """Per length: hit + memcpy (the floor) and hit + the target's allowance, ms."""
    hit = dict(zip(*series(recs, "sidecar", "hit"), strict=True))
    xs, floor, target = [], [], []
    for r in sorted(
        (r for r in recs if r["figure"] == "restore" and r["arm"] == "sidecar"),
        key=lambda r: r["length"],
    ):
        if r["length"] in hit and r["memcpy_s"]["median"] is not None:
            xs.append(r["length"])
            floor.append(hit[r["length"]] + r["memcpy_s"]["median"] * 1e3)
            target.append(hit[r["length"]] + r["limit_s"]["median"] * 1e3)
    return xs, floor, target


def draw(recs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=100)
    arms = [
        a for a in COLOR if any(r.get("arm") == a for r in recs if r["figure"] == "three_states")
    ]
    for arm in arms:
        for state, style in STYLE.items():
            x, y = series(recs, arm, state)
            if not x:
                continue
            ax.plot(x, y, style, color=COLOR[arm], label=f"{arm}: {state}", alpha=0.9)
            if state != "cold":
                zoom.plot(x, y, style, color=COLOR[arm], label=f"{arm}: {state}", alpha=0.9)
    xs, floor, target = floors(recs)
    if xs:
        for a in (ax, zoom):
            a.plot(xs, floor, ":", color="black", label="memcpy floor (hit + memcpy of the bytes)")
        zoom.plot(xs, target, "--", color="tab:red", label="target (hit + memcpy/0.8 + 5 ms)")
    ax.set_yscale("log")
    ax.set_title("time to first token by state", fontsize=10)
    zoom.set_title("hits and restores (linear)", fontsize=10)
    for a in (ax, zoom):
        a.set_xlabel("prompt tokens")
        a.set_ylabel("TTFT, ms (median)")
        a.grid(alpha=0.3)
        lengths = sorted({r["length"] for r in recs if r["figure"] == "three_states"})
        a.set_xticks(lengths)
    zoom.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="center right")
    zoom.legend(fontsize=7, loc="upper left")
    meta = next((r for r in recs if "machine" in r), {})
    m = meta.get("machine", {})
    loads = [
        x
        for r in recs
        if r["figure"] == "three_states"
        for x in (r["load"]["min"], r["load"]["max"])
        if x is not None
    ]
    load = f", load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    fig.suptitle(
        f"vLLM CPU engine, model '{meta.get('model', '?')}', {meta.get('rounds', '?')} rounds, "
        f"{m.get('cpus', '?')} cores{load} (medians)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    draw(load(argv[0]), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
