"""`python -m loadtest.micro.cuda_copy --sweep --dry-run` (issue 54): the sweep's every row on a
CPU machine, through the sidecar's copy path and the CUDA double (host memory), bytes
checked both ways. The device figures are docs/gpu.md's; here only the run is checked."""

from __future__ import annotations

import re

import pytest

from loadtest.micro import cuda_copy as bench_cuda
from sidecar.transports import base, cuda_ipc
from sidecar.transports.cuda_double import HostCuda

needs_kvcopy = pytest.mark.skipif(
    cuda_ipc._kvcopy is None or not hasattr(cuda_ipc._kvcopy, "cuda_plan"),
    reason="sidecar/_kvcopy.c not built",
)


@pytest.fixture
def small(monkeypatch):
    """Requests of at most 1 MiB, plans of 32 runs (so a request is several plans)."""
    monkeypatch.setattr(bench_cuda, "DRY_BYTES", 1 << 20)
    monkeypatch.setattr(base, "YIELD_RUNS", 32)
    monkeypatch.setattr(bench_cuda, "YIELD_RUNS", 32)


def rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if re.match(r"^\s+\d+ (KiB|MiB) ", line)]


@needs_kvcopy
def test_the_dry_sweep_runs_every_row_one_driver_call_a_plan(small, capsys):
    assert bench_cuda.main(["--sweep", "--dry-run"]) == 0
    out = capsys.readouterr().out
    table = rows(out)
    assert len(table) == 2 * 2 * len(bench_cuda.SWEEP)  # contiguous, scattered; set, get
    assert {(r[3], r[4]) for r in table} == {
        (lay, way) for lay in ("contiguous", "scattered") for way in ("set", "get")
    }
    for r in table:
        pages, runs_per_page, calls = int(r[2]), float(r[5]), int(r[6])
        runs = round(runs_per_page * pages)
        if r[3] == "contiguous":
            assert runs == -(-pages // 32)  # one run a plan: host slots placed in a row
        assert calls == -(-pages // 32)  # one cuMemcpyBatchAsync a plan
    assert "one cuMemcpyBatchAsync a plan" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("bench_cuda sweep: dry run, not device figures:")
    assert "us per 1,000 runs" in last and "runs per page contiguous" in last


@needs_kvcopy
def test_the_dry_sweep_fails_when_the_bytes_come_back_wrong(small, monkeypatch, capsys):
    monkeypatch.setattr(HostCuda, "_batch_13000", lambda self, *a: 0)  # copies nothing
    monkeypatch.setattr(bench_cuda, "SWEEP", ((8 << 10, 64),))
    assert bench_cuda.main(["--sweep", "--dry-run"]) == 1
    assert "the pages came back wrong" in capsys.readouterr().out


def test_without_a_device_the_sweep_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cuda_ipc.CudaIpc, "create", classmethod(lambda cls: None))
    assert bench_cuda.main(["--sweep"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
