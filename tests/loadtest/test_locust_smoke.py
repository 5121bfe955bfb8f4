"""The Locust load test, headless and short: it must finish with no failed request."""

import csv
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_locust_smoke_has_no_failures(spawn, tmp_path):
    p = spawn("--host-pool", "256MiB", "--no-file-tier").wait_ready()
    locust = os.path.join(os.path.dirname(sys.executable), "locust")
    prefix = str(tmp_path / "run")
    out = subprocess.run(
        [
            locust,
            "-f",
            "loadtest/micro/locustfile.py",
            "--headless",
            "-u",
            "4",
            "-r",
            "4",
            "-t",
            "12s",
            "--host",
            p.socket_url,
            "--only-summary",
            "--csv",
            prefix,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LOCUST_PAGE_BYTES": "16384"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(prefix + "_stats.csv") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    total = rows["Aggregated"]
    assert int(total["Request Count"]) > 500 and int(total["Failure Count"]) == 0
    for name in ("exists", "get", "set", "verify", "inline put"):
        assert int(rows[name]["Request Count"]) > 0, name
