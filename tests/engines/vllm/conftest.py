"""vLLM engine tests run in .venv-vllm (`make test-vllm`). In the project's own .venv, where
vLLM is not installed, they skip; with KV_SIDECAR_REQUIRE_VLLM=1 a missing vLLM fails."""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("KV_SIDECAR_REQUIRE_VLLM"):
        raise pytest.UsageError("vllm is not installed: `make test-vllm` builds .venv-vllm")
    skip = pytest.mark.skip(reason="vllm is not installed (make test-vllm)")
    for item in items:
        if "engines/vllm" in item.nodeid:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from tests.engines.vllm.tiny_model import build
    return build(str(tmp_path_factory.mktemp("tiny-llama")))


class Engine:
    """`engine_proc` as a child: one JSON command in, one JSON answer out."""

    def __init__(self, model: str, url: str, token: str | None = None):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
               "PYTHONUNBUFFERED": "1"}
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


@pytest.fixture
def engines():
    started: list[Engine] = []

    def start(model: str, url: str, token: str | None = None) -> Engine:
        e = Engine(model, url, token)
        started.append(e)
        return e
    yield start
    for e in started:
        if e.proc.poll() is None:
            e.proc.kill()
            e.proc.wait()
