"""`make bench-3fs` runs end to end at a small size, both layouts, and what it reports
holds where it does not depend on the machine's load: the slotted tier finds another node's
1,000 pages with a few file-system calls where the file-per-page tier makes one a page."""

import subprocess
import sys

import orjson
import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_bench_3fs_small_run():
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.micro.hf3fs", "--pages", "3000", "--nodes", "3",
         "--seconds", "1", "--latency-pages", "40", "--rate", "300", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    slotted, file = orjson.loads(out.stdout.strip().splitlines()[-1])
    assert slotted["layout"] == "slotted" and file["layout"] == "file"
    for res in (slotted, file):
        assert [s["pages"] for s in res["starts"]] == [3000] * 3
        assert res["latency"]["found"] == 40 and res["metadata"]["found"] == 1000
        assert res["restart"]["pages"] >= 3000 and res["memory"]["pages"] >= 3000
    assert slotted["metadata"]["ops"] <= 20 < 1000 <= file["metadata"]["ops"]
    assert slotted["latency"]["p99_s"] < 5 and slotted["cpu"]["found"] == slotted["cpu"]["pages"]
    assert "exists on another p99 (s)" in out.stdout and "metadata ops" in out.stdout
