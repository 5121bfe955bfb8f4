"""One real vLLM CPU engine with the SidecarConnector, driven by JSON lines on stdin.

    python -m tests.engines.vllm.engine_proc MODEL_DIR SIDECAR_URL [TOKEN]
    stdin:  {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8, "reset": true}
            {"op": "ttft", "prompt": [ids...]}     (reset, then one token, timed)
            {"op": "quit"}
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


def engine(model: str, url: str, token: str | None):
    from vllm import LLM
    extra = {"sidecar_url": url, **({"sidecar_token": token} if token else {})}
    max_len = int(os.environ.get("ENGINE_MAX_MODEL_LEN", "512"))
    kv_bytes = int(os.environ.get("ENGINE_KV_BYTES", str(64 << 20)))
    return LLM(model=model, dtype="float32", max_model_len=max_len, block_size=32, enforce_eager=True,
               enable_prefix_caching=True, kv_cache_memory_bytes=kv_bytes, seed=0,
               kv_transfer_config={"kv_connector": "SidecarConnector",
                                   "kv_connector_module_path": "api.vllm_connector",
                                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                   "kv_connector_extra_config": extra})


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
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens or 0 for o in outs]}


def ttft(llm, cmd: dict) -> dict:
    from vllm import SamplingParams
    reset(llm)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": cmd["prompt"]}], params, use_tqdm=False)[0]
    return {"seconds": time.perf_counter() - start, "cached": out.num_cached_tokens or 0}


def main() -> None:
    model, url = sys.argv[1], sys.argv[2]
    token = sys.argv[3] if len(sys.argv) > 3 else None
    llm = engine(model, url, token)
    print("@@ " + json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        answer = generate(llm, cmd) if cmd["op"] == "generate" else ttft(llm, cmd)
        print("@@ " + json.dumps(answer), flush=True)
    del llm


class Engine:
    """`engine_proc` as a child: one JSON command in, one JSON answer out."""

    def __init__(self, model: str, url: str, token: str | None = None, **env_extra: str):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
               "PYTHONUNBUFFERED": "1", **env_extra}
        env.pop("PYTHONHASHSEED", None)
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.engines.vllm.engine_proc", model, url, *([token] if token else [])],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._answer(300)

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
