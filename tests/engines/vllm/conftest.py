"""vLLM engine tests run in .venv-vllm (`make test-vllm`). In the project's own .venv, where
vLLM is not installed, they skip; with KV_SIDECAR_REQUIRE_VLLM=1 a missing vLLM fails."""

from __future__ import annotations

import importlib.util
import os

import pytest

from loadtest.kit.vllm.engine import Engine


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
    from loadtest.kit.vllm.tiny_model import build

    return build(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def engines():
    started: list[Engine] = []

    def start(model: str, url: str, token: str | None = None, **env: str) -> Engine:
        e = Engine(model, url, token, **env)
        started.append(e)
        return e

    yield start
    for e in started:
        if e.proc.poll() is None:
            e.proc.kill()
            e.proc.wait()
