"""`vllm serve` processes on loopback for `make bench-serve` and the vLLM suite's served
test: each started with deploy/engine-vllm.yaml's flags (lib.serve_args), its
OpenAI API on a free port, plus the bench's sizing flags; a streamed completion client;
vLLM's prompt-token counters from /metrics; a process's CPU seconds and RSS from /proc."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from loadtest.kit.procs import ROOT, free_port
from loadtest.serving import lib as sl

BLOCK = 32


def sizing(max_model_len: int, kv_bytes: int) -> list[str]:
    """The bench's flags beside the manifest's: the tiny model's dtype and block, a KV cache
    of `kv_bytes` (small: vLLM's own cache evicts), eager mode, usage with cached tokens."""
    return [
        "--dtype=float32",
        f"--max-model-len={max_model_len}",
        f"--block-size={BLOCK}",
        "--enforce-eager",
        f"--kv-cache-memory-bytes={kv_bytes}",
        "--seed=0",
        "--enable-prompt-tokens-details",
    ]


def cores() -> list[int]:
    """The cores this process may run on, in order (engines inherit them)."""
    return sorted(os.sched_getaffinity(0))


def core_share(i: int, n: int, cpus: Sequence[int]) -> str:
    """Engine `i` of `n`'s OpenMP cores (VLLM_CPU_OMP_THREADS_BIND): the cores split into `n`
    contiguous shares, round the ring when engines outnumber cores. vLLM's own default binds
    every engine to the same cores, so on a small machine n engines spin n x threads there.

        cpus 0 1 2 3, n=2: engine 0 -> "0,1", engine 1 -> "2,3"
        cpus 0 1,     n=4: engines 0..3 -> "0", "1", "0", "1"
    """
    if not cpus or n < 1 or not 0 <= i < n:
        raise ValueError(f"no core share for engine {i} of {n} on {list(cpus)}")
    size = max(1, len(cpus) // n)
    start = (i * size) % len(cpus)
    return ",".join(str(c) for c in list(cpus)[start : start + size])


class Server:
    """One `vllm serve` child (loadtest.serving.cli); `wait()` until /health answers."""

    def __init__(
        self,
        model: str,
        connector: dict | None,
        extra: Sequence[str] = (),
        python: str | None = None,
        env: dict | None = None,
    ):
        self.port = free_port()
        self.model = model
        args = sl.serve_args(model, self.port, connector, extra)
        full = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        full.update(
            {
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
                    "VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores()))
                ),
                "PYTHONUNBUFFERED": "1",
                **(env or {}),
            }
        )
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (open as long as the server)
            "w+", prefix="vllm-serve-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [python or sys.executable, "-m", "loadtest.serving.cli", "serve", *args],
            cwd=ROOT,
            env=full,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait(self, timeout: float = 900) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited {self.proc.returncode}:\n{self.output()[-6000:]}"
                )
            try:
                if self.get("/health")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vllm serve not ready in {timeout} s:\n{self.output()[-6000:]}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def get(self, path: str) -> tuple[int, str]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read().decode()
        finally:
            c.close()

    def complete(self, prompt: list[int], max_tokens: int, timeout: float = 600) -> dict:
        return stream_completion("127.0.0.1", self.port, self.model, prompt, max_tokens, timeout)

    def prompt_tokens(self) -> dict:
        """vLLM's `vllm:prompt_tokens_by_source` counters: local_compute, local_cache_hit,
        external_kv_transfer (tokens)."""
        return prompt_tokens_by_source(self.get("/metrics")[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def stream_completion(
    host: str, port: int, model: str, prompt: list[int], max_tokens: int, timeout: float = 600
) -> dict:
    """One streamed /v1/completions call, greedy, `max_tokens` exactly: status, TTFT at the
    first streamed token, e2e, the answer's token ids and usage's cached tokens."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
    )
    start = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    out: dict = {
        "status": None,
        "ttft": None,
        "tokens": [],
        "cached_tokens": None,
        "start": time.time(),
    }
    try:
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["error"] = f"{r.status}: {r.read()[:500]!r}"
            return out
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                if ch.get("token_ids"):
                    if out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - start
                    out["tokens"] += ch["token_ids"]
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                out["cached_tokens"] = details.get("cached_tokens")
    except OSError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        c.close()
        out["e2e"] = time.perf_counter() - start
        out["end"] = out["start"] + out["e2e"]
    return out


def prompt_tokens_by_source(metrics: str) -> dict:
    got = {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
    for line in metrics.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            for src in got:
                if f'source="{src}"' in line:
                    got[src] += float(line.rsplit(" ", 1)[1])
    return got


def proc_usage(pid: int) -> dict:
    """CPU seconds (user + system) and RSS / peak RSS (bytes) of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / tick
    mem = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                mem[line.split(":")[0]] = int(line.split()[1]) * 1024
    return {"cpu_s": cpu, "rss": mem.get("VmRSS", 0), "peak_rss": mem.get("VmHWM", 0)}
