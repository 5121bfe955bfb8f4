"""One real vLLM CPU engine with the SidecarConnector, driven by JSON lines on stdin.

    python -m tests.engines.vllm.engine_proc MODEL_DIR SIDECAR_URL [TOKEN]
    stdin:  {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8, "reset": true}
            {"op": "ttft", "prompt": [ids...]}     (reset, then one token, timed)
            {"op": "quit"}
    stdout: "@@ " + JSON per command ({"ready": ...} first); everything else is vLLM's log.

`reset` empties vLLM's own prefix cache first, so a cached token can only come from the
sidecar. Greedy sampling: the same KV gives the same tokens.
"""
from __future__ import annotations

import json
import os
import sys
import time


def engine(model: str, url: str, token: str | None):
    from vllm import LLM
    extra = {"sidecar_url": url, **({"sidecar_token": token} if token else {})}
    return LLM(model=model, dtype="float32", max_model_len=512, block_size=32, enforce_eager=True,
               enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20, seed=0,
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


if __name__ == "__main__":
    main()
