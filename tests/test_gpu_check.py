"""scripts/gpu_check.sh --dry: every step of the GPU check but the device, as a CPU machine
runs it (issue 46). The device run itself is docs/gpu.md's."""

import os
import pathlib
import subprocess
import sys

import pytest

from sidecar.transports.cuda_ipc import cuda_available
from tests.conftest import ROOT

STEPS = ("env:", "wheels:", "sidecar:", "gpu tests:", "linker device path:", "bench:")


@pytest.mark.slow
@pytest.mark.skipif(cuda_available(), reason="a GPU is present: the dry run is for CPU machines")
def test_the_dry_run_passes_every_step_and_the_gpu_tests_skip(scratch):
    out = pathlib.Path(scratch(prefix="gpu-check-"))
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_CHECK_LIMIT": "240"}
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = (out / "summary.txt").read_text().splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    lines = {s: next((li for li in summary if li.startswith(s)), None) for s in STEPS}
    assert all(lines.values()), summary
    assert all(" FAIL" not in li and "TIMEOUT" not in li for li in summary), summary
    assert "sidecar sees CUDA: False" in lines["env:"]
    assert "cudaHostRegister-ed: False" in lines["sidecar:"]
    for step in ("gpu tests:", "linker device path:"):  # device tests skip cleanly, CPU ones pass
        assert (
            "skipped" in lines[step] and "failed" not in lines[step] and "error" not in lines[step]
        )
    assert "no CUDA device" in lines["bench:"]
    assert summary[-1].startswith("gpu_check: PASS")
    for log in ("env", "sidecar", "gpu", "linker", "bench"):
        assert (out / f"{log}.log").stat().st_size > 0


@pytest.mark.slow
def test_failing_steps_fail_the_check_and_every_step_still_runs(scratch):
    """Steps that break (here an interpreter that fails every command) mark the check FAIL,
    and every later step still prints its line and writes its log."""
    out = pathlib.Path(scratch(prefix="gpu-check-"))
    env = {**os.environ, "PYTHON": "false", "OUT": str(out), "GPU_CHECK_LIMIT": "60"}
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = (out / "summary.txt").read_text().splitlines()
    assert run.returncode == 1
    for step in STEPS:
        assert any(li.startswith(step) for li in summary), summary
    assert any(li.startswith("gpu tests: FAIL") for li in summary)
    assert summary[-1].startswith("gpu_check: FAIL")
    assert (out / "bench.log").exists()


@pytest.mark.slow
def test_the_hard_limit_holds(scratch):
    """Out of time, the steps left are TIMEOUT at once: the check ends near its limit."""
    out = pathlib.Path(scratch(prefix="gpu-check-"))
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_CHECK_LIMIT": "3"}
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    summary = (out / "summary.txt").read_text().splitlines()
    assert run.returncode == 1
    assert any(li.startswith("gpu tests: TIMEOUT") for li in summary), summary
    assert int(summary[-1].split(" in ")[-1].rstrip("s")) <= 10
