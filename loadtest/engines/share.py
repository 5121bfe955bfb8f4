"""The sharing figure of `make bench-engines`: N tiny vLLM engines, requests round-robin, a
multi-turn slice of the conversation trace, with one shared sidecar against one sidecar per
engine holding 1/N of the memory each (the same total).

    trace slice: every request of the first K conversations with 2+ turns (a conversation:
                 requests sharing a prefix of 2+ blocks), in trace order; each 512-token
                 trace block becomes one 32-token KV block (the same id, the same tokens)
    per request: both arms, in alternating order; vLLM's own prefix cache is emptied after
                 each request (which also waits for its saves), so every hit is the sidecar's
    hit rate:    blocks loaded (num_cached_tokens, and the sidecars' hit counters) / blocks,
                 against `sidecar plan SLICE --capacities C --engines N` with C the pages
                 the shared sidecar held
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from api.engine.client import SidecarClient
from loadtest.engines import lib as lib
from loadtest.kit.procs import ROOT, start_sidecar
from loadtest.kit.vllm.engine import Engine
from loadtest.kit.vllm.tiny_model import SIZES, build

BLOCK = 32
TRACE = str(Path(ROOT).parent / "shared" / "traces" / "conversation_trace.jsonl")


def add_args(ap) -> None:
    ap.add_argument("--share-engines", type=int, default=4)
    ap.add_argument("--share-conversations", type=int, default=80)
    ap.add_argument(
        "--share-max-blocks", type=int, default=120, help="leave out longer conversations"
    )
    ap.add_argument(
        "--share-pool-mib",
        type=int,
        default=0,
        help="total host pool (MiB, 1 MiB segments); 0: a quarter of the slice's blocks",
    )
    ap.add_argument("--share-trace", default=TRACE)


def slice_trace(args, outdir: Path) -> tuple[list[dict], Path]:
    with open(args.share_trace) as f:
        lines = f.readlines()
    reqs = [json.loads(x) for x in lines]
    idx = lib.multi_turn_slice(reqs, args.share_conversations, max_blocks=args.share_max_blocks)
    path = outdir / "share-slice.jsonl"
    path.write_text("".join(lines[i] for i in idx))
    return [reqs[i] for i in idx], path


def plan(path: Path, capacity: int, engines: int) -> dict:
    """`sidecar plan` on the slice: the shared and the per-engine block hit rates."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "api.cli",
            "plan",
            str(path),
            "--capacities",
            str(capacity),
            "--engines",
            str(engines),
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    row = json.loads(out.strip().splitlines()[-1])["rows"][0]
    return {"shared": row["hit_rate_blocks"], "split": row["per_engine"]["hit_rate_blocks"]}


def share_phase(args, tmp: str, out) -> None:
    outdir = Path(args.out)
    reqs, path = slice_trace(args, outdir)
    n = args.share_engines
    unique = len({h for r in reqs for h in r["hash_ids"]})
    model = build(f"{tmp}/model-share", size="share")
    _, layers, _, kv_heads, head_dim, *_ = SIZES["share"]
    page = lib.kv_page_bytes(layers, kv_heads, head_dim, BLOCK)
    pool = args.share_pool_mib or max(n, round(unique * page / 4 / 2**20 / n) * n)
    env = {
        "ENGINE_MAX_MODEL_LEN": str(args.share_max_blocks * BLOCK + 64),
        "ENGINE_KV_BYTES": str(128 << 20),
    }
    with ExitStack() as stack:
        with lib.sidecar_env(args.sidecar_env):
            shared = start_sidecar("--no-file-tier", "--host-pool", f"{pool}MiB")
            stack.callback(shared.stop)
            split = []
            for _ in range(n):
                s = start_sidecar("--no-file-tier", "--host-pool", f"{pool // n}MiB")
                stack.callback(s.stop)
                split.append(s)
        engines = {"shared": [], "split": []}
        for i in range(n):
            for arm, url in (("shared", shared.socket_url), ("split", split[i].socket_url)):
                e = Engine(model, url, **env)
                stack.callback(e.close)
                engines[arm].append(e)
        results = {"shared": [], "split": []}
        loads = []
        for k, req in enumerate(reqs):
            prompt = lib.trace_prompt(req["hash_ids"], BLOCK)
            loads.append(_load())
            for arm in ("shared", "split") if k % 2 == 0 else ("split", "shared"):
                got = engines[arm][k % n].ask(
                    timeout=600, op="run", prompt=prompt, max_tokens=1, reset_after=True
                )
                if "error" in got:
                    raise RuntimeError(f"sharing {arm}: {got['error']}")
                results[arm].append(
                    {
                        "ttft": got["ttft"],
                        "blocks": len(req["hash_ids"]),
                        "hit": lib.blocks_for(got["cached"], BLOCK),
                    }
                )
            if k % 25 == 0:
                print(f"sharing: {k + 1}/{len(reqs)} requests", flush=True)
        stats = {
            "shared": [SidecarClient(shared.socket_url).stats()],
            "split": [SidecarClient(s.socket_url).stats() for s in split],
        }
    cap = sum(ns["capacity_pages"] for st in stats["shared"] for ns in st["namespaces"].values())
    want = plan(path, cap, n)
    for arm in ("shared", "split"):
        out.emit(
            share_record(
                arm, results[arm], stats[arm], want[arm], n, len(reqs), unique, cap, pool, loads
            )
        )


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def share_record(
    arm: str,
    res: list[dict],
    stats: list[dict],
    planned: float,
    engines: int,
    requests: int,
    unique: int,
    capacity: int,
    pool_mib: int,
    loads: list[float],
) -> dict:
    blocks = sum(r["blocks"] for r in res)
    hit = sum(r["hit"] for r in res) / max(blocks, 1)
    counted = sum(lib.Counters.of(st).hits for st in stats) / max(blocks, 1)
    ttft = [r["ttft"] for r in res]
    return {
        "figure": "sharing",
        "arm": arm,
        "engines": engines,
        "requests": requests,
        "unique_blocks": unique,
        "capacity_pages": capacity
        if arm == "shared"
        else [sum(ns["capacity_pages"] for ns in st["namespaces"].values()) for st in stats],
        "pool_mib": pool_mib if arm == "shared" else pool_mib // engines,
        "hit_rate_blocks": hit,
        "hit_rate_counters": counted,
        "plan_hit_rate_blocks": planned,
        "met": lib.within(hit, planned),
        "ttft_p50_s": lib.percentile(ttft, 50),
        "ttft_p99_s": lib.percentile(ttft, 99),
        "load": lib.summary(loads),
    }


def share_table(recs: list[dict]) -> str:
    rows = []
    for r in recs:
        rows.append(
            (
                r["arm"],
                r["engines"],
                r["requests"],
                f"{r['pool_mib']} MiB",
                f"{r['hit_rate_blocks']:.3f}",
                f"{r['hit_rate_counters']:.3f}",
                f"{r['plan_hit_rate_blocks']:.3f}",
                "met" if r["met"] else "NOT met",
                lib.fmt_ms(r["ttft_p50_s"] * 1e3),
                lib.fmt_ms(r["ttft_p99_s"] * 1e3),
                f"{r['load']['min']:.1f}-{r['load']['max']:.1f}",
            )
        )
    return "Sharing: one sidecar vs one per engine (same total memory)\n\n" + lib.table(
        [
            "arm",
            "engines",
            "requests",
            "pool each",
            "block hit rate",
            "by counters",
            "sidecar plan",
            "within 10%",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "load",
        ],
        rows,
    )
