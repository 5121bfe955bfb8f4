"""The chaos soak, short and seeded: every fault kind injected, then the verdict.

`python -m loadtest.chaos.soak` runs as its own process (it monkey-patches with gevent), with two
sidecars of its own. Every violation it reports must be 0 (issue 11's write-back loss at
SIGTERM and on a full queue, deletes that came back and temporaries left behind were seen
here before their fixes; they now fail this test like any other violation).
"""

import json
import os
import subprocess
import sys

import pytest

from loadtest.chaos.ledger import Ledger, Node
from tests.conftest import ROOT

KINDS = ("sigkill", "sigterm", "disk_fill", "ns_delete", "stall")


def run_soak(tmp_path, seed: int, duration: int, *extra: str) -> tuple[int, dict, str]:
    cmd = [
        sys.executable,
        "-m",
        "loadtest.chaos.soak",
        "--seed",
        str(seed),
        "--duration",
        str(duration),
        "--gap",
        "3",
        "--workdir",
        str(tmp_path / "soak"),
        *extra,
    ]
    out = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("CHAOS-SUMMARY ")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    return out.returncode, json.loads(lines[-1][len("CHAOS-SUMMARY ") :]), out.stdout[-4000:]


@pytest.mark.slow
def test_chaos_soak_short_seeded(tmp_path):
    rc, s, log = run_soak(tmp_path, seed=11, duration=40)
    for kind in KINDS:
        assert s["faults"][kind] >= 1, f"{kind} never injected\n{log}"
    assert s["requests"] > 500 and s["pages_checked"] > 1000, log
    assert s["checks"] >= 5, log  # each restart and namespace delete is checked, and the end
    second = s["tenants"]["second"]  # another uid's engine on the write_through sidecar
    assert second["acked_pages"] > 100, log
    assert second["uid"] == (65534 if os.geteuid() == 0 else os.geteuid()), log
    seen = {
        (what, node): n
        for what, per in s["violations_by_node"].items()
        for node, n in per.items()
        if n
    }
    assert not seen, f"violations: {seen}\n{log}"
    assert rc == 0, log


@pytest.mark.slow
def test_chaos_soak_with_a_shared_3fs_tier(tmp_path):
    """Both nodes also write one 3FS dir (the slotted tier, issue 55) on the soak's disk:
    killed mid-write, filled, restarted; no violation, and the tier was used."""
    rc, s, log = run_soak(tmp_path, 13, 30, "--tiers", "3fs")
    assert s["tiers"] == "3fs" and s["requests"] > 200, log
    seen = {(w, n): c for w, per in s["violations_by_node"].items() for n, c in per.items() if c}
    assert not seen, f"violations: {seen}\n{log}"
    assert all(t["hf3fs_pages_max"] > 0 for t in s["tier"].values()), log  # it was used
    assert rc == 0, log


# -- the ledger's verdicts, without processes (each rule forced) ---------------------------


def ledger_with(policy: str = "write_back") -> tuple[Ledger, Node]:
    led, node = Ledger(seed=3, page_bytes=64), Node("n", policy)
    led.owner["ns"] = node
    return led, node


def acked(led: Ledger, key: str, start: float, durable: bool = False) -> None:
    led.set_started("ns", [key], start)
    led.set_done("ns", [key], [True], start, start + 0.1, durable)


def test_ledger_sorts_each_miss_into_one_bucket():
    led, node = ledger_with()
    acked(led, "before-kill", 1.0)
    node.stops.append((2.0, "sigkill"))
    acked(led, "before-term", 3.0)
    node.stops.append((4.0, "sigterm"))
    acked(led, "running", 5.0)
    for p in led.settled(node, 6.0):
        led.judge(node, p, present=False)
    assert led.counts["allowed_sigkill"] == 1
    assert led.counts["lost_after_sigterm"] == 1 and led.counts["lost_running"] == 1
    assert led.settled(node, 7.0) == []  # a miss is counted once


def test_ledger_durable_and_deleted_pages():
    led, node = ledger_with("write_through")
    acked(led, "flag", 1.0, durable=True)
    acked(led, "flushed", 1.0)
    assert led.flushed(node, 2.0) == 1
    acked(led, "gone", 1.0)
    led.deleted("ns", ["gone"], 2.5, 2.6)
    node.stops.append((3.0, "sigkill"))  # durable pages must survive it
    present = {"flag": False, "flushed": False, "gone": True}
    for p in led.settled(node, 4.0):
        led.judge(node, p, present[p.key])
    assert led.counts["lost_durable_flag"] == 1 and led.counts["lost_durable_flush"] == 1
    assert led.counts["deleted_came_back"] == 1


def test_ledger_budgets_and_races():
    led, node = ledger_with()
    acked(led, "a", 1.0)
    acked(led, "b", 1.0)
    led.disk_filled()  # both may meet a failed write from now on
    node.poll({"tiers": {"file": {"evictions": 1}}, "write_queue": {"failed": 1}})
    acked(led, "c", 1.2)  # after the fill: no excuse
    led.set_started("ns", ["raced"], 1.0)  # in flight while the delete runs
    led.deleted("ns", ["raced"], 1.5, 1.6)
    led.set_done("ns", ["raced"], [True], 1.0, 1.7)
    for p in led.settled(node, 2.0):
        led.judge(node, p, False)
    assert led.counts["evicted_by_tier"] == 1 and led.counts["allowed_disk_full"] == 1
    assert led.counts["lost_running"] == 1 and led.examples["lost_running"][0].startswith("ns/c ")
    assert all(p.key != "raced" for p in led.settled(node, 2.0))
    assert led.served("ns", "x", led.bytes_of("ns", "x")) and not led.served("ns", "x", b"\0" * 64)
    assert led.counts["wrong_bytes"] == 1
