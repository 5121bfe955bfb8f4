"""Schemathesis over the app's OpenAPI schema, both valid and invalid inputs: no 5xx
(but 504/507, which the contract documents as answers), and the process survives."""

import os
import re
import subprocess
import sys

import pytest

from api.engine.client import SidecarClient
from tests.conftest import ROOT


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(spawn):
    p = spawn("--host-pool", "64MiB", "--no-file-tier").wait_ready()
    st = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    out = subprocess.run(
        [
            st,
            "--config-file",
            "loadtest/micro/schemathesis.toml",
            "run",
            f"{p.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "25",
            "--seed",
            "1",
            "--workers",
            "1",
            "--request-timeout",
            "30",
            "--mode",
            "all",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    cases = re.search(r"(\d+) generated, (\d+) passed", out.stdout)
    assert cases and int(cases.group(1)) == int(cases.group(2)) > 500, out.stdout[-2000:]
    assert "Tested: 32" in out.stdout  # every operation of the schema
    assert SidecarClient(p.url).health() == {"status": "ok"}
