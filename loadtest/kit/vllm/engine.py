"""One real vLLM CPU engine with the SidecarConnector, driven by JSON lines on stdin.

    python -m loadtest.kit.vllm.engine MODEL_DIR SIDECAR_URL [TOKEN]
    stdin:  {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8, "reset": true}
            {"op": "ttft", "prompt": [ids...]}     (reset, then one token, timed)
            {"op": "run", "prompt": [ids...], "max_tokens": 4, "reset": false, "reset_after": false}
                (the engine's step loop: time to first token, tokens, num_cached_tokens)
            {"op": "batch", "prompts": [[ids...], ...], "max_tokens": 16}   (throughput)
            {"op": "reset"}
            {"op": "quit"}
    env:    ENGINE_CONNECTOR sidecar | none | lmcache, ENGINE_EXTRA (JSON extra config),
            ENGINE_RESTORE_COST=1 (the connector's restore cost rule; off by default here),
            ENGINE_MAX_MODEL_LEN, ENGINE_KV_BYTES, ENGINE_MAX_BATCHED_TOKENS, ENGINE_DTYPE
    stdout: "@@ " + JSON per command ({"ready": ...} first); everything else is vLLM's log.
`Engine` below is the parent's side: it starts this script and exchanges the lines.

`reset` empties vLLM's own prefix cache first, so a cached token can only come from the
sidecar. Greedy sampling: the same KV gives the same tokens.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def transfer_config(url: str, token: str | None) -> dict | None:
    """ENGINE_CONNECTOR: `sidecar` (default; `url` is the sidecar's), `none`, or `lmcache`
    (LMCache's multiprocess connector; `url` is its server, tcp://HOST:PORT). ENGINE_EXTRA
    (JSON) is merged into the connector's extra config."""
    kind = os.environ.get("ENGINE_CONNECTOR", "sidecar")
    more = json.loads(os.environ.get("ENGINE_EXTRA", "{}"))
    if kind == "none":
        return None
    if kind == "lmcache":
        host, _, port = url.rpartition(":")
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": host,
                "lmcache.mp.port": int(port),
                **more,
            },
        }
    # the restore cost rule (issue 44) would recompute these tests' tiny-model restores, which
    # are what they check (and what bench-engines times): on only with ENGINE_RESTORE_COST=1
    rule = {"restore_cost": os.environ.get("ENGINE_RESTORE_COST") == "1"}
    extra = {"sidecar_url": url, **({"sidecar_token": token} if token else {}), **rule, **more}
    return {
        "kv_connector": "SidecarConnector",
        "kv_connector_module_path": "api.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def engine(model: str, url: str, token: str | None):
    from vllm import LLM

    max_len = int(os.environ.get("ENGINE_MAX_MODEL_LEN", "512"))
    kv_bytes = int(os.environ.get("ENGINE_KV_BYTES", str(64 << 20)))
    batched = os.environ.get("ENGINE_MAX_BATCHED_TOKENS")
    kw = {"max_num_batched_tokens": int(batched)} if batched else {}
    tc = transfer_config(url, token)
    dtype = os.environ.get("ENGINE_DTYPE", "float32")
    return LLM(
        model=model,
        dtype=dtype,
        max_model_len=max_len,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=kv_bytes,
        seed=0,
        **({"kv_transfer_config": tc} if tc else {}),
        **kw,
    )


def reset(llm, timeout: float = 30.0) -> None:
    """Empty vLLM's prefix cache; blocks of finished requests are freed once their saves
    are reported, a few engine steps later."""
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache did not reset")
        time.sleep(0.05)


def generate(llm, cmd: dict) -> dict:
    from vllm import SamplingParams

    if cmd.get("reset"):
        reset(llm)
    params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 8), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], params, use_tqdm=False)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "cached": [o.num_cached_tokens or 0 for o in outs],
    }


def ttft(llm, cmd: dict) -> dict:
    from vllm import SamplingParams

    reset(llm)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": cmd["prompt"]}], params, use_tqdm=False)[0]
    return {"seconds": time.perf_counter() - start, "cached": out.num_cached_tokens or 0}


def run(llm, cmd: dict) -> dict:
    """One prompt through the engine's own step loop: time to first token and to the end,
    the greedy tokens and vLLM's `num_cached_tokens`. `reset` empties vLLM's prefix cache
    before, `reset_after` after (which also waits until the request's saves are reported)."""
    from vllm import SamplingParams

    if cmd.get("reset"):
        reset(llm)
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 1), ignore_eos=True)
    rid = f"run-{time.monotonic_ns()}"
    start = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": cmd["prompt"]}, params)
    first = None
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id != rid:
                continue
            out = o
            if first is None and o.outputs and o.outputs[0].token_ids:
                first = time.perf_counter() - start
    total = time.perf_counter() - start
    if cmd.get("reset_after"):
        reset(llm)
    return {
        "ttft": first,
        "seconds": total,
        "tokens": list(out.outputs[0].token_ids),
        "cached": out.num_cached_tokens or 0,
    }


def batch(llm, cmd: dict) -> dict:
    """Throughput: every prompt at once, `max_tokens` each; wall seconds and tokens."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 16), ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "prompt_tokens": sum(len(p) for p in cmd["prompts"]),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "cached": [o.num_cached_tokens or 0 for o in outs],
    }


OPS = {
    "generate": generate,
    "ttft": ttft,
    "run": run,
    "batch": batch,
    "reset": lambda llm, cmd: (reset(llm), {"reset": True})[1],
}


def main() -> None:
    model, url = sys.argv[1], sys.argv[2]
    token = sys.argv[3] if len(sys.argv) > 3 else None
    llm = engine(model, url, token)
    print("@@ " + json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            answer = OPS[cmd["op"]](llm, cmd)
        except Exception as exc:  # the parent sees the error instead of a hang
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print("@@ " + json.dumps(answer), flush=True)
    del llm


class Engine:
    """`engine_proc` as a child: one JSON command in, one JSON answer out."""

    def __init__(
        self,
        model: str,
        url: str,
        token: str | None = None,
        python: str | None = None,
        **env_extra: str,
    ):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # sha256 needs none
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                "PYTHONUNBUFFERED": "1",
                **env_extra,
            }
        )
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (the engine writes it until it exits)
        self.proc = subprocess.Popen(
            [
                python or sys.executable,
                "-m",
                "loadtest.kit.vllm.engine",
                model,
                url,
                *([token] if token else []),
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._answer(600)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.answers.put(json.loads(line[3:]))
            else:
                self.log.write(line)
        self.answers.put(None)

    def _answer(self, timeout: float) -> dict:
        try:
            answer = self.answers.get(timeout=timeout)
        except queue.Empty:
            answer = None
        if answer is None:
            raise RuntimeError(f"engine gave no answer:\n{self.output()[-6000:]}")
        return answer

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def ask(self, timeout: float = 180, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def close(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                return self.proc.wait(timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        return self.proc.wait()


if __name__ == "__main__":
    main()
