"""The benchmark command runs end to end (tiny sizes; the figures are not checked here)."""

import subprocess
import sys

import orjson
import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_bench_quick_json():
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "loadtest.micro.bench", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = orjson.loads(out.stdout.strip().splitlines()[-1])
    assert res["exists"]["sidecar_rps"] > 0 and res["exists"]["bare_rps"] > 0
    assert res["shm"]["set_gbps"] > 0 and res["shm"]["copy_gbps"] > 0
    assert res["batch_exists"]["ratio"] > 0 and res["batch_partial"]["cpu_ratio"] > 0
    assert res["inline"]["get_gbps"] > 0
    assert (
        res["exists"]["cpu_us"] > 0
        and res["exists"]["bare_cpu_us"] >= 0
        and res["client"]["ratio"] > 0
    )
    assert (
        "exists 1000 keys" in out.stdout
        and "us CPU/request" in out.stdout
        and "vs torch copy" in out.stdout
    )


@pytest.mark.slow
def test_bench_socket_reaches_the_engine_sockets_namespaces_over_tcp():
    """`make bench`'s second half: TCP reads and writes the namespaces made on the engine
    socket, which takes the token since namespaces have owners (docs/security.md)."""
    from loadtest.micro import unix_socket as bench_socket

    res = bench_socket.run(1, 10)
    assert res["exists"]["tcp"]["req_s"] > 0 and res["exists"]["uds"]["req_s"] > 0
    assert res["small_moves"]["tcp_inline_get"]["gb_s"] > 0
    assert res["ratios"]["fd_vs_mmap_get_gb_s"] > 0


@pytest.mark.slow
def test_bench_events_runs_both_sidecars():
    from loadtest.micro import events as bench_events

    res = bench_events.run(1, 20, 4096, ring=1 << 20)  # the fill: until a 1 MiB ring wraps
    assert res["set"]["on_rps"] > 0 and res["set"]["off_rps"] > 0
    assert res["exists"]["on_rps"] > 0 and res["exists"]["rps_ratio"] > 0  # CPU: 10 ms ticks


def test_bench_stalls_runs_each_scenario_against_its_limit():
    """`python -m loadtest.micro.stalls` end to end at a small size (figures unchecked)."""
    from loadtest.micro import stalls as bench_stalls

    res = bench_stalls.run(pages=4096, keys=256)
    assert set(res) == {"full_pool", "neighbour", "drop"}
    assert all(r["ms"] > 0 and r["limit_ms"] > 0 and r["ratio"] > 0 for r in res.values())


def test_bench_restore_times_each_restore_beside_its_burners():
    """`python -m loadtest.micro.restore` end to end at small sizes (figures unchecked):
    every restore is one move the sidecar timed, and the burners are gone after it."""
    from loadtest.micro import restore as bench_restore

    args = bench_restore.parse(
        ["--sizes", "1,2", "--rounds", "2", "--layers", "3", "--run-kib", "16", "--busy", "1"]
    )
    rows = bench_restore.run(args)
    assert [r["mib"] for r in rows] == [1, 2] and all(r["rounds"] == 2 for r in rows)
    assert all(r["copy_s"] > 0 and r["memcpy_s"] > 0 and r["limit_s"] > 0.005 for r in rows)
    assert all(r["bytes"] == r["mib"] * 2**20 // (3 * 16384) * 3 * 16384 for r in rows)
    assert not _children_running("while True: pass")


def _children_running(code: str) -> list[int]:
    """Pids of this process's children whose command line holds `code`."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == os.getpid() and code.encode() in cmd:
            found.append(int(pid))
    return found
