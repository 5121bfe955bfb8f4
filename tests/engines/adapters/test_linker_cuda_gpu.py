"""The SGLang linker's device path on a GPU (issue 28's CUDA part), without SGLang's package:
the linker's own `api.engine.sglang_linker_cuda` (what `SidecarLinker` calls on a GPU) drives
a pool laid out as SGLang's MHA pool (tests/engines/adapters/linker_cuda_proc.py). Covered: the pool is
registered once by CUDA IPC; the sidecar copies pages on its streams only after the linker's
event completed; pages of one engine process restored byte-exact into other pages of
another's. Not covered here: SidecarLinker's queues and SGLang's layer counter (the SGLang
suite runs those on CPU pools, through staging)."""

import os
import subprocess
import sys

import orjson
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu
ENV = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}


def engine(url: str, ns: str, op: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.engines.adapters.linker_cuda_proc", url, ns, op],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return orjson.loads(out.stdout.strip().splitlines()[-1])


def test_device_pool_offloaded_after_its_event_and_loaded_into_another_engine(spawn):
    p = spawn("--host-pool", "1GiB", "--no-file-tier").wait_ready()
    wrote = engine(p.socket_url, "linker-kv", "offload")
    assert wrote["stored"] == [True, True, True] and wrote["buffers"] == 1  # one registration
    assert len(set(wrote["pages"])) == 3
    read = engine(p.socket_url, "linker-kv", "load")
    assert read["loaded"] == [True, True, True] and read["buffers"] == 1
    assert read["pages"] == wrote["pages"]  # pages 2, 5, 7 of engine 1 in 0, 3, 4 of engine 2
    assert read["untouched_zero"]


def test_without_the_gate_the_copy_races_the_forward_pass(spawn):
    """The control for the gate: the same offload without waiting on the event stores the
    pages as they were before the late writes (zeros), so the gated test can fail."""
    p = spawn("--host-pool", "1GiB", "--no-file-tier").wait_ready()
    wrote = engine(p.socket_url, "linker-race", "offload-ungated")
    read = engine(p.socket_url, "linker-race", "load")
    assert wrote["stored"] == [True, True, True] and read["loaded"] == [True, True, True]
    if read["pages"] == wrote["pages"]:
        # seen on an H200 (2026-11-28) with a 50 ms sleep: the sidecar's copy ran only after
        # the engine's kernel, as if the two processes' contexts took turns on the GPU
        pytest.skip(
            "the device ran the sidecar's copy after the engine's ~2 s kernel: the race "
            "the gate prevents cannot be shown on it (contexts serialized)"
        )
    assert read["pages"] != wrote["pages"]
