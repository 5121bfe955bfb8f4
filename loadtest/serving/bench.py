"""`make bench-serve` (issues 44, 53): fleets of `vllm serve` engines under Locust, the sidecar
beside no connector and LMCache at equal host memory, on two shapes of the trace.

    python -m loadtest.serving.bench [--engines 2,4] [--levels 1,4,8] [--policies rr,sticky]
        [--shapes conversations,trace] [--arms none,shared,defaults,split,lmcache]
        [--requests 160] [--trace-requests 120 --trace-scale 4 --time-scale 0]
        [--trace-sample 1] [--rounds 1]
        [--lmcache-python PY] [--out DIR]

Shapes: `conversations` (multi-turn: each prompt the previous turn's and its answer plus
new tokens, so most of it is a restore) and `trace` (the trace's requests in its order,
its hash blocks as shared prefixes: mostly new prompts, so every request pays the store;
loadtest/serving/trace_replay.py). For each fleet size and arm one fleet starts (the flags of
deploy/engine-vllm.yaml, each engine's KV cache `--kv-mib`: small, so vLLM's own cache
evicts), then every shape, policy and level runs in turn, each on requests of its own
(users = level x engines): a conversation user plays `--warmup` + ceil(`--requests` /
users) requests; trace users take the next request of the level's `--trace-requests`;
each user's first `--warmup` are dropped, so every arm serves the same requests on the
same engines. `--rounds R` runs each level R times in a row, each round on the next
requests; the report pools a level's rounds (its requests paired across arms by round).
Each engine's OpenMP threads run on its own share of the cores (`--omp-bind split`;
`all`: every engine on every core). Arms, each with `--pool-mib` in
all beneath the engines: `none`; `shared` (one sidecar, no file tier); `defaults` (one
sidecar as `make serve` starts it: the file tier, write-through); `split` (one sidecar per
engine, 1/N each, no file tier); `lmcache` (LMCache 0.5.6's MP server, L1 the same size).
The sidecar arms' connectors write a timeline (api/engine/vllm_timeline.py): each row says
where its requests' time went (`breakdown`).
Out: DIR/bench-serve.jsonl (one row per fleet, arm, shape, policy, level),
DIR/requests-*.jsonl (every request), DIR/timeline-*.jsonl; `python -m
loadtest.serving.report DIR` prints the tables, breakdowns and targets and draws one
TTFT CDF per arm.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from api.engine.client import SidecarClient
from loadtest.engines import lib as lib
from loadtest.kit.procs import ROOT, start_sidecar
from loadtest.kit.vllm.tiny_model import SIZES, build
from loadtest.serving import fleet as fl
from loadtest.serving import lib as sl
from loadtest.serving import trace_replay as bt

TRACE = str(Path(ROOT).parent / "shared" / "traces" / "conversation_trace.jsonl")
# the sidecars' token, fresh each run (loopback is open to every local user); also the
# operator's: /v1/stats names a tokenless TCP caller no namespace
TOKEN = secrets.token_hex(16)
AUTH = ("--token", TOKEN)


class Arm:
    """One arm's cache beneath the engines: its processes, connector configs and counters."""

    def __init__(self, name: str, args, n: int, stack: ExitStack):
        self.name, self.sidecars, self.lmcache = name, [], None
        self.out = args.out
        self.timelines: list[Path] = []
        if name == "shared":
            self.sidecars = [
                start_sidecar("--no-file-tier", "--host-pool", f"{args.pool_mib}MiB", *AUTH)
            ]
        elif name == "defaults":  # what `make serve` gives a user: the file tier, write-through
            tier = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-serve-tier-"))
            self.sidecars = [
                start_sidecar("--data-dir", tier, "--host-pool", f"{args.pool_mib}MiB", *AUTH)
            ]
        elif name == "split":
            self.sidecars = [
                start_sidecar("--no-file-tier", "--host-pool", f"{args.pool_mib // n}MiB", *AUTH)
                for _ in range(n)
            ]
        elif name == "lmcache":
            from loadtest.engines.bench import LMCacheServer

            self.lmcache = LMCacheServer(
                args.lmcache_python, args.pool_mib / 1024, Path(args.out) / f"lmcache-{n}.log"
            )
            stack.callback(self.lmcache.stop)
        for s in self.sidecars:
            stack.callback(s.stop)

    def connector(self, i: int) -> dict | None:
        if self.sidecars:
            cfg = sl.sidecar_connector(self.sidecars[i % len(self.sidecars)].socket_url)
            cfg["kv_connector_extra_config"]["sidecar_token"] = TOKEN
            self.timelines.append(Path(self.out) / f"timeline-{self.name}-{i}.jsonl")
            self.timelines[-1].write_text("")
            cfg["kv_connector_extra_config"]["timeline"] = str(self.timelines[-1])
            return cfg
        if self.lmcache:
            host, _, port = self.lmcache.url.rpartition(":")
            return {
                "kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": host,
                    "lmcache.mp.port": int(port),
                    "lmcache.mp.mp_transfer_mode": "lmcache_driven",
                    "lmcache.mp.mq_timeout": 120,
                },
            }
        return None

    def timeline(self, start: float, end: float) -> list[dict]:
        """The connectors' timeline rows stamped inside [start, end]."""
        rows = [
            json.loads(x) for p in self.timelines for x in p.read_text().splitlines() if x.strip()
        ]
        return bt.within(rows, start, end)

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.sidecars] + (
            [self.lmcache.proc.pid] if self.lmcache else []
        )

    def counters(self) -> lib.Counters:
        total = lib.Counters()
        for s in self.sidecars:
            c = lib.Counters.of(SidecarClient(s.url, token=TOKEN).stats())
            total = lib.Counters(
                total.hits + c.hits, total.misses + c.misses, total.bytes_out + c.bytes_out
            )
        return total


def usage(pids: list[int]) -> dict:
    got = [fl.proc_usage(p) for p in pids]
    return {
        "cpu_s": sum(g["cpu_s"] for g in got),
        "rss": sum(g["rss"] for g in got),
        "peak_rss": sum(g["peak_rss"] for g in got),
    }


def plan(args, shape: str, users: int, work: list, offset: int) -> tuple[dict, str]:
    """A level's Locust plan (without engines, model, policy, out) and its user class:
    conversations offset+u, offset+u+users, ... a user, or the trace's requests from
    `offset` on, in order."""
    if shape == "trace":
        cut = (args.trace_scale, args.max_model_len - 256)
        reqs = bt.trace_requests(work[offset:], args.trace_requests, *cut)
        before = bt.trace_requests(work[:offset], offset, *cut)  # the caches hold them
        block = bt.block_of(args.trace_scale)
        return {
            "requests": [list(vars(r).values()) for r in reqs],
            "block": block,
            "time_scale": args.time_scale,
            "shared_fraction": bt.shared_fraction(reqs),  # of its blocks, an earlier one's
            "prefix_fraction": bt.prefix_fraction(reqs, block, before),
        }, "TraceUser"
    return {
        "per_user": sl.per_user(args.requests, users, args.warmup),
        "users": [
            [{"cid": c.cid, "turns": [list(vars(t).values()) for t in c.turns]} for c in mine]
            for mine in sl.assign(work, users, offset)
        ],
    }, "ConversationUser"


def snapshot(arm: Arm, servers: list) -> tuple:
    """vLLM's prompt-token counters and request-time histograms, the arm's counters, its
    processes' usage."""
    metrics = [s.get("/metrics")[1] for s in servers]
    return (
        [fl.prompt_tokens_by_source(m) for m in metrics],
        arm.counters(),
        usage(arm.pids()),
        [bt.vllm_times(m) for m in metrics],
    )


def run_level(args, arm: Arm, servers: list, model: str, level: dict) -> dict:
    """One shape, policy and level through Locust; its row (figures, counters, usage, where
    the time went)."""
    n, shape, policy, users_per = len(servers), level["shape"], level["policy"], level["level"]
    users = users_per * n
    tag = f"{arm.name}-{n}-{policy}-{users_per}"
    tag = f"trace-{tag}" if shape == "trace" else tag
    tag += f"-r{level['round']}" if level["round"] else ""
    out = Path(args.out) / f"requests-{tag}.jsonl"
    out.write_text("")
    body, user_class = plan(args, shape, users, level["work"], level["offset"])
    plan_path = Path(args.out) / f"plan-{tag}.json"
    body.update(
        engines=[s.port for s in servers], model=model, policy=policy, out=str(out), shape=shape
    )
    plan_path.write_text(json.dumps(body))
    before = snapshot(arm, servers)
    cmd = [args.locust, "-f", str(Path(ROOT) / "loadtest" / "serving" / "users.py"), user_class]
    cmd += ["--headless", "-u", str(users), "-r", str(users), "-t", f"{args.max_seconds}s"]
    cmd += ["--only-summary", "--stop-timeout", "600"]
    subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "SERVE_PLAN": str(plan_path), "PYTHONPATH": ROOT},  # a checkout's
        check=False,
        stdout=subprocess.DEVNULL,
    )
    after = snapshot(arm, servers)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    recs.sort(key=lambda r: r["end"])
    src = {
        k: sum(a[k] - b[k] for a, b in zip(after[0], before[0], strict=True)) for k in after[0][0]
    }
    delta = after[1] - before[1]
    loads = sum(1 for r in recs if (r.get("cached_tokens") or 0) > 0)
    span = (min(r["start"] for r in recs), max(r["end"] for r in recs)) if recs else (0, 0)
    return {
        "shape": shape,
        "arm": arm.name,
        "engines": n,
        "policy": policy,
        "users_per_engine": users_per,
        "users": users,
        **sl.level_summary(recs, args.warmup),
        "warmup": args.warmup,
        "vllm_tokens": src,
        "sidecar": {
            "hits": delta.hits,
            "misses": delta.misses,
            "bytes_out": delta.bytes_out,
            "agree": sl.counters_agree(
                delta.hits + delta.misses, int(src["external_kv_transfer"]), loads, fl.BLOCK
            )
            if arm.sidecars
            else None,
        },
        "breakdown": bt.breakdown(before[3], after[3], arm.timeline(*span), len(recs)),
        "cache_cpu_s": after[2]["cpu_s"] - before[2]["cpu_s"],
        "cache_rss": after[2]["rss"],
        "cache_peak_rss": after[2]["peak_rss"],
        "conversations_from": level["offset"],
        "round": level["round"],
        "trace_shared": body.get("shared_fraction"),
        "trace_prefix": body.get("prefix_fraction"),
    }


def binds(args, i: int, n: int) -> dict:
    """Engine `i`'s OpenMP binding: its own share of the cores (`--omp-bind split`), or every
    core as vLLM's default (`all`), as every arm of one run is bound alike."""
    if args.omp_bind == "all":
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": fl.core_share(i, n, fl.cores())}


def run_arm(args, name: str, n: int, model: str, work_of: dict, emit) -> None:
    with ExitStack() as stack:
        arm = Arm(name, args, n, stack)
        extra = fl.sizing(args.max_model_len, args.kv_mib << 20)
        python = args.lmcache_python if name == "lmcache" else None
        env = {"PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false"} if name == "lmcache" else {}
        servers = [
            fl.Server(
                model, arm.connector(i), extra, python=python, env={**env, **binds(args, i, n)}
            )
            for i in range(n)
        ]
        for s in servers:
            stack.callback(s.stop)
        for s in servers:
            s.wait()
        offsets = {"conversations": 0, "trace": 0}
        for shape in args.shapes:
            for policy in args.policies:
                for users_per in args.levels:
                    for rnd in range(args.rounds):
                        level = dict(
                            shape=shape,
                            policy=policy,
                            level=users_per,
                            work=work_of[shape],
                            offset=offsets[shape],
                            round=rnd,
                        )
                        emit(run_level(args, arm, servers, model, level))
                        offsets[shape] += (
                            args.trace_requests
                            if shape == "trace"
                            else users_per * n * args.conversations_per_user
                        )


def parse(argv=None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(
        prog="bench_serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="build/bench-serve")
    ap.add_argument("--engines", type=ints, default=[2, 4])
    ap.add_argument("--levels", type=ints, default=[1, 4, 8], help="users per engine")
    ap.add_argument("--policies", type=lambda s: s.split(","), default=["rr", "sticky"])
    ap.add_argument(
        "--arms",
        type=lambda s: s.split(","),
        default=["none", "shared", "defaults", "split", "lmcache"],
    )
    ap.add_argument(
        "--shapes",
        type=lambda s: s.split(","),
        default=["conversations", "trace"],
        help="conversations (multi-turn), trace (the trace's requests in order)",
    )
    ap.add_argument("--requests", type=int, default=160, help="requests measured per level")
    ap.add_argument(
        "--rounds", type=int, default=1, help="each level again on the next requests, pooled"
    )
    ap.add_argument("--trace-requests", type=int, default=120, help="trace shape: a level's")
    ap.add_argument("--trace-scale", type=int, default=4, help="trace tokens per bench token")
    ap.add_argument(
        "--trace-sample",
        type=int,
        default=1,
        help="trace shape: every turn of the conversations whose sha256 is 0 mod this",
    )
    ap.add_argument(
        "--time-scale", type=float, default=0.0, help="trace shape: x its timestamps (0: none)"
    )
    ap.add_argument("--warmup", type=int, default=1, help="requests per user dropped first")
    ap.add_argument(
        "--conversations-per-user", type=int, default=4, help="conversations set aside a user"
    )
    ap.add_argument("--model-size", default="bench", choices=sorted(SIZES))
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--kv-mib", type=int, default=128, help="each engine's own KV cache")
    ap.add_argument(
        "--pool-mib", type=int, default=1024, help="host memory beneath the engines, every arm"
    )
    ap.add_argument("--scale", type=int, default=16, help="trace tokens per bench token")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-seconds", type=int, default=3600, help="Locust's limit per level")
    ap.add_argument("--lmcache-python", default=None)
    ap.add_argument(
        "--omp-bind",
        default="split",
        choices=["split", "all"],
        help="each engine's OpenMP threads on its own share of the cores, or all on every core",
    )
    ap.add_argument("--locust", default=str(Path(ROOT) / ".venv" / "bin" / "locust"))
    ap.add_argument("--trace", default=TRACE)
    args = ap.parse_args(argv)
    if "lmcache" in args.arms and not args.lmcache_python:
        args.arms.remove("lmcache")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(x) for x in Path(args.trace).read_text().splitlines()]
    work_of = {"conversations": sl.conversations(rows, args.scale, args.max_model_len - 64)}
    work_of["trace"] = bt.sample(rows, args.trace_sample)
    path = outdir / "bench-serve.jsonl"
    path.write_text("")
    meta = {
        "model": args.model_size,
        "kv_mib": args.kv_mib,
        "pool_mib": args.pool_mib,
        "scale": args.scale,
        "trace_scale": args.trace_scale,
        "trace_sample": args.trace_sample,
        "time_scale": args.time_scale,
        "cpus": os.cpu_count(),
        "omp_bind": args.omp_bind,
    }

    def emit(row: dict) -> None:
        row = {**row, **meta, "load": lib.summary([os.getloadavg()[0]])["median"]}
        with path.open("a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        print(json.dumps(row, sort_keys=True), flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        model = build(args.model_dir or f"{tmp}/model-{args.model_size}", size=args.model_size)
        for n in args.engines:
            for name in args.arms:
                run_arm(args, name, n, model, work_of, emit)
    from loadtest.serving.report import report

    print(report(outdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
