"""`make bench-engines`: the sidecar judged at the engine level, on the real vLLM CPU engine,
beside no connector and LMCache 0.5.6's multiprocess server, in one run (issues 27, 33).

    python -m loadtest.engines.bench [--rounds 4] [--lengths 1024,4096,8192]
        [--lmcache-python .venv-lmcache/bin/python] [--out DIR] [--skip-share]

Figures (one JSON line each in DIR/bench-engines.jsonl, Markdown tables on stdout and in
DIR/bench-engines.md; `loadtest.engines.chart` draws DIR/bench-engines.png):
  three_states     TTFT of a prompt cold; hit in the engine's own prefix cache; restored
                   after `reset_prefix_cache()`; restored by a second engine process. A
                   run counts only when its proof holds (lib.prove).
  restore          restored - in-engine hit, bytes loaded, GB/s, beside a one-thread memcpy
                   of the same bytes timed in the same round; target bytes/(0.8 memcpy) + 5 ms
  issue33          restore TTFT against LMCache's; in-engine hit against no connector
  store_on_miss    unique prompts (0% hits): cold TTFT and batch throughput, connector / none
  sharing          (share.py) N tiny engines round-robin on a multi-turn slice of
                   the conversation trace: one shared sidecar vs one per engine, 1/N each

Arms run interleaved: each round takes every prompt length in turn, and for each, every arm
in an order that rotates from round to round; the first `--warmup` rounds are dropped.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from api.engine.client import SidecarClient
from loadtest.engines import lib as lib
from loadtest.engines.report import restore_figures
from loadtest.kit.procs import free_port, start_sidecar
from loadtest.kit.vllm.engine import Engine
from loadtest.kit.vllm.tiny_model import SIZES, build

BLOCK = 32
STATES = ("cold", "hit", "restored", "cross")
ARMS = ("none", "sidecar", "sidecar+nt", "lmcache")
# glibc's memmove switches to non-temporal stores only above ~3/4 of the cache (99 MB here):
# the sidecar's 64 KiB runs (one layer of one block) get them with this tunable
NT_ENV = ["GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x10000"]


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def machine() -> dict:
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) * 1024
    return {
        "cpus": os.cpu_count(),
        "mem_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


class Out:
    """JSON lines as they come (file and stdout); the records for the tables."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta, self.records = path, meta, []
        path.write_text("")

    def emit(self, rec: dict) -> dict:
        rec = {**rec, **self.meta}
        self.records.append(rec)
        with self.path.open("a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
        print(json.dumps(rec, sort_keys=True), flush=True)
        return rec


class LMCacheServer:
    """`lmcache server` (0.5.6, the multiprocess server on the CPU) from its own venv."""

    def __init__(self, python: str, l1_gb: float, log_path: Path):
        self.port, http = free_port(), free_port()
        exe = str(Path(python).parent / "lmcache")
        env = {
            **os.environ,
            "PYTHONHASHSEED": "0",
            "LMCACHE_TRACK_USAGE": "false",
            "LMCACHE_DISABLE_BANNER": "1",
        }
        self.log = log_path.open("w")
        self.cmd = [
            exe,
            "server",
            "--port",
            str(self.port),
            "--http-port",
            str(http),
            "--l1-size-gb",
            str(l1_gb),
            "--eviction-policy",
            "LRU",
            "--disable-metrics",
            "--supported-transfer-mode",
            "auto",
        ]
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"lmcache server exited {self.proc.returncode}: {log_path.read_text()[-3000:]}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("lmcache server did not start in 300 s")

    @property
    def url(self) -> str:
        return f"tcp://localhost:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class Memcpy:
    """The limit: one thread copying n bytes between two warm buffers, as glibc's memmove
    (ctypes) and as a torch copy; the faster of the two medians is the memcpy."""

    def __init__(self, nbytes: int, run: int):
        import torch

        torch.set_num_threads(1)
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.run = run

    def seconds(self, n: int, reps: int = 5) -> tuple[float, float, float]:
        """(memmove, torch copy, memmove in `run`-byte pieces) medians of `reps`, interleaved.
        The last is what the page layout allows at best: one layer of one block is one run."""
        mm, tc, pieces = [], [], []
        src, dst = self.src.data_ptr(), self.dst.data_ptr()
        for _ in range(reps):
            t = time.perf_counter()
            ctypes.memmove(dst, src, n)
            mm.append(time.perf_counter() - t)
            t = time.perf_counter()
            self.dst[:n].copy_(self.src[:n])
            tc.append(time.perf_counter() - t)
            t = time.perf_counter()
            for off in range(0, n, self.run):
                ctypes.memmove(dst + off, src + off, min(self.run, n - off))
            pieces.append(time.perf_counter() - t)
        return tuple(sorted(x)[reps // 2] for x in (mm, tc, pieces))


def counters(sidecar) -> lib.Counters | None:
    return (
        lib.Counters.of(SidecarClient(sidecar.socket_url).stats()) if sidecar is not None else None
    )


def settle(sidecar, seconds: float) -> None:
    """Let the cold run's saves land before the hit is timed: `seconds`, and for a sidecar,
    until its stored pages stop changing (every arm waits the same `seconds`)."""
    time.sleep(seconds)
    if sidecar is None:
        return
    last, deadline = None, time.monotonic() + 60
    while time.monotonic() < deadline:
        now = sum(
            ns["stored"] for ns in SidecarClient(sidecar.socket_url).stats()["namespaces"].values()
        )
        if now == last:
            return
        last = now
        time.sleep(0.2)


def run_states(
    arm: str, engines: list[Engine], sidecar, prompt: list[int], out_tokens: int, pause: float = 1.0
) -> dict:
    """cold, in-engine hit, restored after a reset, and a second engine's restore of one
    new prompt; each with its TTFT, tokens, num_cached_tokens and counter delta."""
    res = {}
    before = counters(sidecar)
    steps = [("cold", engines[0], False), ("hit", engines[0], False)]
    if arm != "none":
        steps += [("restored", engines[0], True), ("cross", engines[1], True)]
    for state, eng, reset in steps:
        if state == "hit":
            settle(sidecar, pause)
        got = eng.ask(timeout=1800, op="run", prompt=prompt, max_tokens=out_tokens, reset=reset)
        if "error" in got:
            raise RuntimeError(f"{arm} {state}: {got['error']}")
        after = counters(sidecar)
        got["delta"] = (after - before) if after is not None else None
        before = after
        res[state] = got
    return res


def prove_states(arm: str, res: dict, n: int, page_bytes: int) -> dict:
    """Each state's proof (see lib.prove); the cold run is the reference."""
    cold = res["cold"]["tokens"]
    local_hit = lib.local_hit(n, BLOCK)
    proofs = {}
    for state, got in res.items():
        local = {"cold": 0, "hit": local_hit}.get(state, 0)
        want = 0 if state == "cold" else lib.expected_cached(arm, n, BLOCK, local)
        proofs[state] = lib.prove(
            got["tokens"], cold, got["cached"], want, local, BLOCK, page_bytes, got["delta"]
        )
    return proofs


def start_engines(args, stack: ExitStack, tmp: str, out: Out) -> tuple[dict, dict, str]:
    model = build(args.model_dir or f"{tmp}/model-{args.model_size}", size=args.model_size)
    max_len = min(max(args.lengths) + 256, SIZES[args.model_size][6])
    env = {"ENGINE_MAX_MODEL_LEN": str(max_len), "ENGINE_KV_BYTES": str(args.kv_mib << 20)}
    sidecars = {}
    for arm in args.arms:
        if arm.startswith("sidecar"):
            with lib.sidecar_env(args.sidecar_env + (NT_ENV if arm == "sidecar+nt" else [])):
                sidecars[arm] = start_sidecar(
                    "--no-file-tier", "--host-pool", f"{args.host_pool_mib}MiB"
                )
            stack.callback(sidecars[arm].stop)
    engines: dict[str, list[Engine]] = {}

    def engine(*a, **kw) -> Engine:
        e = Engine(*a, **kw)
        stack.callback(e.close)
        return e

    if "none" in args.arms:
        engines["none"] = [engine(model, "-", ENGINE_CONNECTOR="none", **env)]
    extra = json.dumps(args.sidecar_extra)
    for arm, sc in sidecars.items():
        engines[arm] = [engine(model, sc.socket_url, ENGINE_EXTRA=extra, **env) for _ in range(2)]
    if args.lmcache_python:
        try:
            srv = LMCacheServer(
                args.lmcache_python, args.lmcache_l1_gb, Path(args.out) / "lmcache-server.log"
            )
            stack.callback(srv.stop)
            lm_extra = {
                "lmcache.mp.mp_transfer_mode": args.lmcache_mode,
                "lmcache.mp.mq_timeout": 120,
            }
            lm_env = {
                **env,
                "ENGINE_CONNECTOR": "lmcache",
                "ENGINE_EXTRA": json.dumps(lm_extra),
                "PYTHONHASHSEED": "0",
                "LMCACHE_TRACK_USAGE": "false",
            }
            engines["lmcache"] = [
                engine(model, srv.url, python=args.lmcache_python, **lm_env) for _ in range(2)
            ]
        except Exception as exc:  # the arm is reported, the rest of the bench goes on
            out.emit({"figure": "lmcache", "ran": False, "error": str(exc)[-4000:]})
            engines.pop("lmcache", None)
    return engines, sidecars, model


def restore_phase(args, tmp: str, out: Out) -> None:
    with ExitStack() as stack:
        engines, sidecars, model = start_engines(args, stack, tmp, out)
        arms = [a for a in ARMS if a in engines]
        page_bytes = kv_page_bytes(args.model_size)
        layers = SIZES[args.model_size][1]
        memcpy = Memcpy(lib.blocks_for(max(args.lengths), BLOCK) * page_bytes, page_bytes // layers)
        runs: list[dict] = []
        loads: list[float] = []
        for rnd in range(args.warmup + args.rounds):
            kept = rnd >= args.warmup
            loads.append(loadavg())
            for li, n in enumerate(args.lengths):
                prompt = lib.prompt(args.seed * 7919 + rnd * 1000 + li, n)
                for k in range(len(arms)):
                    arm = arms[(rnd + li + k) % len(arms)]
                    sc = sidecars.get(arm)
                    res = run_states(arm, engines[arm], sc, prompt, args.out_tokens, args.settle)
                    proofs = prove_states(arm, res, n, page_bytes)
                    nbytes = proofs["restored"].nbytes if "restored" in proofs else 0
                    mm, tc, pieces = memcpy.seconds(nbytes) if nbytes else (None, None, None)
                    runs.append(
                        {
                            "round": rnd,
                            "kept": kept,
                            "arm": arm,
                            "length": n,
                            "memcpy_s": min(mm, tc) if mm else None,
                            "memmove_s": mm,
                            "torch_copy_s": tc,
                            "memmove_runs_s": pieces,
                            "load": loads[-1],
                            "states": {
                                s: {
                                    "ttft": g["ttft"],
                                    "cached": g["cached"],
                                    "tokens": g["tokens"],
                                    "delta": g["delta"] and vars(g["delta"]),
                                    "proof": lib.proof_dict(proofs[s]),
                                }
                                for s, g in res.items()
                            },
                        }
                    )
                    print(
                        f"round {rnd}{'' if kept else ' (warm-up)'} {arm:8} {n:5}: "
                        + ", ".join(
                            f"{s} {g['ttft'] * 1e3:,.1f} ms/{g['cached']}{'' if proofs[s].ok else ' UNPROVEN'}"
                            for s, g in res.items()
                        ),
                        flush=True,
                    )
            if not kept:
                warm_blocks(
                    args,
                    engines,
                    arms,
                    lib.prompt(
                        args.seed * 7919 + rnd * 1000 + len(args.lengths) - 1, args.lengths[-1]
                    ),
                    page_bytes,
                )
            if args.throughput_prompts:
                throughput_round(args, engines, arms, rnd, kept, runs)
        (Path(args.out) / "bench-engines-runs.json").write_text(json.dumps(runs))
        for sc in sidecars.values():
            got = {
                ns["page_bytes"]
                for ns in SidecarClient(sc.socket_url).stats()["namespaces"].values()
            }
            assert got <= {page_bytes}, f"pages of {got} bytes, the bench counts {page_bytes}"
        for rec in restore_figures(runs, arms, args.lengths, page_bytes):
            out.emit(rec)


def warm_blocks(args, engines: dict, arms: list[str], prompt: list[int], page_bytes: int) -> None:
    """Restore the warm-up round's longest prompt until every KV block of every engine has
    been written by a restore once: the cache's first write into each block of a new
    engine's memory costs a page fault per 4 KiB (the sidecar maps the KV cache lazily),
    which a long-running engine has paid. The timed rounds measure that steady state."""
    blocks = (args.kv_mib << 20) // page_bytes
    times = blocks // lib.blocks_for(len(prompt), BLOCK) + 2
    for arm in arms:
        if arm == "none":
            continue
        for eng in engines[arm]:
            for _ in range(times):
                eng.ask(timeout=600, op="run", prompt=prompt, max_tokens=1, reset=True)
    print(f"warm-up: {times} restores of {len(prompt)} tokens on each engine", flush=True)


def throughput_round(
    args, engines: dict, arms: list[str], rnd: int, kept: bool, runs: list[dict]
) -> None:
    """Store-on-miss throughput: a batch of unique prompts through every arm (rotated)."""
    n = args.throughput_length
    for k in range(len(arms)):
        arm = arms[(rnd + k) % len(arms)]
        prompts = [
            lib.prompt(10**6 + args.seed * 7919 + rnd * 100 + i, n)
            for i in range(args.throughput_prompts)
        ]
        got = engines[arm][0].ask(
            timeout=3600, op="batch", prompts=prompts, max_tokens=args.throughput_out
        )
        if "error" in got:
            raise RuntimeError(f"{arm} batch: {got['error']}")
        tokens = got["prompt_tokens"] + got["output_tokens"]
        runs.append(
            {
                "round": rnd,
                "kept": kept,
                "arm": arm,
                "batch": True,
                "seconds": got["seconds"],
                "tokens": tokens,
                "cached": got["cached"],
                "load": loadavg(),
            }
        )
        print(
            f"round {rnd} {arm:8} batch of {len(prompts)} x {n}: {got['seconds']:.2f} s, "
            f"{tokens / got['seconds']:,.0f} tokens/s, cached {sum(got['cached'])}",
            flush=True,
        )


def kv_page_bytes(size: str) -> int:
    """One KV block of every layer of the model `size` (K and V, float32)."""
    hidden, layers, heads, kv_heads, head_dim, *_ = SIZES[size]
    return lib.kv_page_bytes(layers, kv_heads, head_dim, BLOCK)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench_engines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--out", default="bench-engines-out", help="directory for the JSON lines, tables, logs"
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and dropped")
    ap.add_argument(
        "--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 8192]
    )
    ap.add_argument(
        "--arms",
        type=lambda s: s.split(","),
        default=["none", "sidecar"],
        help="none, sidecar, sidecar+nt (its sidecar copies with non-temporal stores: "
        f"{NT_ENV[0]}); LMCache comes with --lmcache-python",
    )
    ap.add_argument(
        "--lmcache-python",
        default=None,
        help="python of a venv with lmcache 0.5.6 (make .venv-lmcache/.installed): adds its arm",
    )
    ap.add_argument("--lmcache-l1-gb", type=float, default=0.75)
    ap.add_argument(
        "--lmcache-mode",
        default="lmcache_driven",
        choices=["lmcache_driven", "engine_driven"],
        help="LMCache's transfer mode (the server runs with --supported-transfer-mode auto)",
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="seconds after the cold run (and until the sidecar's saves stop), every arm",
    )
    ap.add_argument("--model-size", default="bench", choices=sorted(SIZES))
    ap.add_argument("--model-dir", default=None, help="keep the random model here (built once)")
    ap.add_argument(
        "--kv-mib", type=int, default=256, help="each engine's KV cache (8k tokens: 192 MiB)"
    )
    ap.add_argument("--host-pool-mib", type=int, default=768, help="each sidecar's host pool")
    ap.add_argument(
        "--out-tokens", type=int, default=4, help="greedy tokens compared with the cold run"
    )
    ap.add_argument(
        "--sidecar-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the sidecar process only (repeatable)",
    )
    ap.add_argument(
        "--sidecar-extra",
        type=json.loads,
        default={},
        help="JSON merged into the connector's kv_connector_extra_config",
    )
    ap.add_argument("--throughput-prompts", type=int, default=8, help="0: no throughput figure")
    ap.add_argument("--throughput-length", type=int, default=1024)
    ap.add_argument("--throughput-out", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-restore", action="store_true")
    ap.add_argument("--skip-share", action="store_true")
    from loadtest.engines.share import add_args

    add_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": machine(),
        "model": args.model_size,
        "rounds": args.rounds,
        "sidecar_env": args.sidecar_env,
    }
    out = Out(outdir / "bench-engines.jsonl", meta)
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        if not args.skip_restore:
            restore_phase(args, tmp, out)
        if not args.skip_share:
            from loadtest.engines.share import share_phase

            share_phase(args, tmp, out)
    from loadtest.engines.report import tables

    text = tables(out.records)
    (outdir / "bench-engines.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
