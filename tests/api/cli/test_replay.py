"""Trace replay against a real sidecar, beside the exact LRU simulation."""

import os
import subprocess
import sys

import orjson
import pytest

from tests.conftest import ROOT

TRACE = os.path.join(ROOT, "..", "shared", "traces", "conversation_trace.jsonl")


def trace_path() -> str:
    """The shared trace; a skip on a bare checkout, a failure where it must be there (CI:
    .ci/run sets KV_SIDECAR_CI=1, and CI always has ../shared beside the clone)."""
    if not os.path.exists(TRACE):
        if os.environ.get("KV_SIDECAR_CI") == "1":
            pytest.fail(
                f"KV_SIDECAR_CI=1 but the shared trace is missing: {os.path.abspath(TRACE)}"
            )
        pytest.skip("the shared conversation trace is not beside this checkout")
    return TRACE


def replay(url, *args):
    out = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "api.cli",
            "replay",
            trace_path(),
            "--url",
            url,
            "--json",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return orjson.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_replay_hit_rate_equals_the_lru_simulation(spawn):
    p = spawn("--host-pool", "64MiB", "--no-file-tier").wait_ready()
    for capacity in (300, 2000):
        res = replay(
            p.socket_url,
            "--page-bytes",
            "1024",
            "--capacity-pages",
            str(capacity),
            "--limit",
            "400",
        )
        assert res["requests"] == 400 and res["pages"] > 0
        assert res["hit_rate_blocks"] == res["sim_hit_rate_blocks"] > 0
        assert res["hit_rate_tokens"] == res["sim_hit_rate_tokens"]
        assert res["evictions"] == res["sim_evictions"] and res["failed_loads"] == 0
        assert res["hits_from"]["tiers"] == 0
        assert set(res["latency_ms"]) >= {"p50", "p90", "p99"} and res["gbps"] > 0


@pytest.mark.slow
def test_replay_with_tiers_reports_where_hits_came_from(spawn, tmp_path):
    p = spawn("--host-pool", "64MiB", "--data-dir", str(tmp_path / "d")).wait_ready()
    # a share smaller than the longest request: tiered gets go in chunks
    res = replay(p.socket_url, "--page-bytes", "1024", "--capacity-pages", "120", "--limit", "400")
    assert res["hit_rate_blocks"] >= res["sim_hit_rate_blocks"]  # the file tier only adds hits
    assert res["hits_from"]["tiers"] > 0 and res["failed_loads"] == 0
