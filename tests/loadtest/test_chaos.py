"""The chaos soak, short and seeded: every fault kind injected, then the verdict.

`python -m loadtest.chaos` runs as its own process (it monkey-patches with gevent), with two
sidecars of its own. Each violation it reports must be 0; the ones listed in KNOWN are bugs
of issue 11 that other branches are fixing: while one of those (and nothing else) is seen,
the test is an expected failure naming it, so the merge of the fix turns it green.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

KINDS = ("sigkill", "sigterm", "disk_fill", "ns_delete", "stall")
# (violation, node) -> the issue 11 bug it shows; node "wt" is write_through, "wb" write_back
KNOWN = {
    ("lost_after_sigterm", "wb"): "write_back: SIGTERM does not write the host pool's pages (item 1)",
    ("lost_running", "wb"): "write_back: an eviction with the write queue full drops the page (item 1)",
    ("deleted_came_back", "wt"): "queued writes publish after a delete (item 2)",
    ("deleted_came_back", "wb"): "queued writes publish after a delete (item 2)",
    ("temps_left", "-"): "temporary page files left behind (item 3)",
}


def run_soak(tmp_path, seed: int, duration: int) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "loadtest.chaos", "--seed", str(seed), "--duration", str(duration),
           "--gap", "3", "--workdir", str(tmp_path / "soak")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("CHAOS-SUMMARY ")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    return out.returncode, json.loads(lines[-1][len("CHAOS-SUMMARY "):]), out.stdout[-4000:]


@pytest.mark.slow
def test_chaos_soak_short_seeded(tmp_path):
    rc, s, log = run_soak(tmp_path, seed=11, duration=40)
    for kind in KINDS:
        assert s["faults"][kind] >= 1, f"{kind} never injected\n{log}"
    assert s["requests"] > 500 and s["pages_checked"] > 1000, log
    assert s["checks"] >= 5, log       # each restart and namespace delete is checked, and the end
    seen = {(what, node): n for what, per in s["violations_by_node"].items() for node, n in per.items() if n}
    unknown = {k: n for k, n in seen.items() if k not in KNOWN}
    assert not unknown, f"violations: {unknown}\n{log}"
    known = sorted(f"{KNOWN[k]}: {n}" for k, n in seen.items())
    if known:
        pytest.xfail("; ".join(known))
    assert rc == 0, log
