"""`sidecar plan`: the offline capacity sweep, its per-engine comparison and its chart."""

import io
import subprocess
import sys

import orjson
import pytest

from api.cli import plan
from api.cli.lru_sim import LruSim
from api.cli.progress import Progress
from tests.api.cli.test_replay import trace_path
from tests.conftest import ROOT


def write_trace(path, requests):
    with open(path, "wb") as f:
        for i, ids in enumerate(requests):
            f.write(
                orjson.dumps({"timestamp": i, "input_length": len(ids) * 512, "hash_ids": ids})
                + b"\n"
            )
    return str(path)


def run_cli(*args):
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "api.cli", "plan", *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr == ""  # no progress bar when stderr is not a terminal
    return orjson.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sweep_matches_the_replay_oracle_and_draws_a_chart(tmp_path):
    reqs = [[0, 1, 2, 3], [0, 1, 4], [5, 6], [0, 1, 2, 7], [5, 6, 8], [0, 9]]
    path = write_trace(tmp_path / "t.jsonl", reqs)
    png = tmp_path / "plan.png"
    res = run_cli(path, "--capacities", "3,100%", "--plot", str(png), "--page-bytes", "1000")
    assert res["unique_pages"] == 10 and [r["capacity_pages"] for r in res["rows"]] == [3, 10]
    for row in res["rows"]:
        sim = LruSim(row["capacity_pages"])
        hits = sum(sim.request([str(k) for k in ids]) for ids in reqs)
        assert row["hit_rate_blocks"] == hits / sum(map(len, reqs))
        assert row["capacity_bytes"] == row["capacity_pages"] * 1000
    # with room for every page, each request hits its whole previously seen prefix
    assert res["rows"][1]["hit_rate_blocks"] == (2 + 3 + 2 + 1) / 18
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_per_engine_caches_miss_what_another_engine_stored(tmp_path):
    # two engines round-robin: every prefix is stored by one engine and asked of the other
    reqs = [[0, 1], [0, 1], [2, 3], [2, 3]] * 3
    path = write_trace(tmp_path / "t.jsonl", reqs)
    res = run_cli(path, "--capacities", "4", "--engines", "2")
    row = res["rows"][0]
    assert row["hit_rate_blocks"] > row["per_engine"]["hit_rate_blocks"]


def test_file_tier_as_a_second_level_only_adds_hits(tmp_path):
    reqs = [[i, i + 1, i + 2] for i in range(0, 30, 3)] * 2  # a working set larger than the host
    path = write_trace(tmp_path / "t.jsonl", reqs)
    res = run_cli(path, "--capacities", "6", "--file-pages", "100")
    row = res["rows"][0]
    assert row["hit_rate_blocks"] == 0  # LRU thrashes: each page is gone before it comes back
    assert row["with_file_tier"]["hit_rate_blocks"] == 0.5  # the second pass hits in the file tier


def test_smaller_pages_split_each_block(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [[0, 1], [0, 1]])
    trace = plan.load(path, 128, None)
    assert len(trace[0].keys) == 8 and trace[0].keys[:2] == ["0.0", "0.1"]
    with pytest.raises(ValueError):
        plan.load(path, 100, None)
    with pytest.raises(ValueError):
        plan.parse_capacities("0", 10)


@pytest.mark.slow
def test_shared_trace_four_engines_at_a_tenth_of_unique_pages():
    """The issue's figures: 0.279 shared against 0.116 per-engine (2.4x)."""
    res = run_cli(trace_path(), "--capacities", "10%", "--engines", "4")
    row = res["rows"][0]
    assert row["hit_rate_blocks"] == pytest.approx(0.279, abs=0.002)
    assert row["per_engine"]["hit_rate_blocks"] == pytest.approx(0.116, abs=0.002)


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal():
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = Progress(4, "replay", stream)
        for _ in range(4):
            bar.update()
        bar.close()
    assert "replay [" in tty.getvalue() and "4/4" in tty.getvalue()
    assert pipe.getvalue() == ""


@pytest.mark.slow
def test_replay_draws_its_progress_bar_on_a_terminal(spawn):
    import os
    import pty

    p = spawn("--host-pool", "16MiB", "--no-file-tier").wait_ready()
    main, sub = pty.openpty()
    try:
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
                p.socket_url,
                "--capacity-pages",
                "100",
                "--page-bytes",
                "1024",
                "--limit",
                "50",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=sub,
            timeout=120,
        )
        os.close(sub)
        drawn = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: every writer has closed
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(main)
    assert out.returncode == 0
    assert b"replay [" in drawn and b"50/50" in drawn
    assert b"replay [" not in out.stdout
