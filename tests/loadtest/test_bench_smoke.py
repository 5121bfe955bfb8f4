"""The benchmark command runs end to end (tiny sizes; the figures are not checked here)."""
import subprocess
import sys

import orjson
import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_bench_quick_json():
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "loadtest.bench", "--quick", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = orjson.loads(out.stdout.strip().splitlines()[-1])
    assert res["exists"]["sidecar_rps"] > 0 and res["exists"]["bare_rps"] > 0
    assert res["shm"]["set_gbps"] > 0 and res["shm"]["copy_gbps"] > 0
    assert res["batch_exists"]["ratio"] > 0 and res["batch_partial"]["cpu_ratio"] > 0
    assert res["inline"]["get_gbps"] > 0
    assert res["exists"]["cpu_us"] > 0 and res["exists"]["bare_cpu_us"] >= 0 and res["client"]["ratio"] > 0
    assert "exists 1000 keys" in out.stdout and "us CPU/request" in out.stdout and "vs torch copy" in out.stdout
