"""`sidecar pin|unpin|evict|warm|pins` (api/cli/ctl.py) against a real sidecar process
with a data dir and a token, across a restart; the warm's progress bar on a terminal."""

import hashlib
import json
import os
import subprocess
import sys

from api.engine.client import SidecarClient
from tests.conftest import ROOT, wait_for

PAGE = 16384
TOKEN = "op-t0ken"


def data(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def ctl(p, *args: str, stderr=None) -> tuple[int, dict]:
    env = {**os.environ, "SIDECAR_TOKEN": TOKEN}
    out = subprocess.run(
        [sys.executable, "-m", "api.cli", *args, "--url", p.url],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        timeout=120,
    )
    return out.returncode, json.loads(out.stdout) if out.stdout.strip() else {}


def start(spawn, tmp_path):
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    return spawn(
        "--host-pool", "32MiB", "--data-dir", str(tmp_path / "data"), "--token-file", str(tok)
    ).wait_ready(TOKEN)


def test_the_cli_pins_evicts_and_warms_across_a_restart(spawn, tmp_path):
    p = start(spawn, tmp_path)
    op = SidecarClient(p.url, token=TOKEN, timeout=30)
    op.put_namespace("kv", PAGE, page_tokens=16)
    chain = [f"c{i}" for i in range(300)]
    for k in chain:
        op.put_page("kv", k, data(k))
    assert op.request("POST", "/v1/flush")[1]["pending"] == 0
    rc, got = ctl(p, "pin", "kv", *chain[:10], "--ttl", "600")
    assert rc == 0 and got["pinned"] == 10
    assert ctl(p, "pins", "kv")[1]["pages"] == 10
    assert ctl(p, "unpin", "kv", "--all")[1]["unpinned"] == 10
    keys = tmp_path / "chain.txt"
    keys.write_text("\n".join(chain) + "\n")
    rc, got = ctl(p, "evict", "kv", "--keys-file", str(keys), "--chain", "--from", "c200")
    assert rc == 0 and got == {"deleted": 100, "failed": 0}
    assert ctl(p, "pin", "kv", "nope")[0] == 0
    assert ctl(p, "pin", "missing-ns", "k")[0] == 1
    rc, out = p.terminate()
    assert rc == 0, out[-2000:]
    q = start(spawn, tmp_path)
    op = SidecarClient(q.url, token=TOKEN, timeout=30)
    op.put_namespace("kv", PAGE, page_tokens=16)
    assert op.stats()["namespaces"]["kv"]["pages"] == {"host": 0, "file": 200}
    rc, got = ctl(q, "warm", "kv", "--keys-file", str(keys), "--chain")
    assert rc == 0 and (got["pages"], got["loaded"], got["failed"]) == (200, 200, [])
    assert op.stats()["namespaces"]["kv"]["pages"]["host"] == 200
    assert op.exists_each("kv", ["c199", "c200"]) == [True, False]


def test_the_warm_draws_a_progress_bar_on_a_terminal(spawn, tmp_path):
    p = start(spawn, tmp_path)
    op = SidecarClient(p.url, token=TOKEN, timeout=30)
    op.put_namespace("kv", PAGE)
    for k in ("a", "b", "c"):
        op.put_page("kv", k, data(k))
    main, side = os.openpty()
    try:
        rc, got = ctl(p, "warm", "kv", "a", "b", "c", "zz", stderr=side)
        os.close(side)
        drawn = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(main)
    assert rc == 0 and got["pages"] == 3
    assert b"warm [" in drawn and b"3/3" in drawn


def test_plan_sizes_a_node_from_a_running_sidecars_cost(spawn, tmp_path):
    import orjson

    p = start(spawn, tmp_path)
    op = SidecarClient(p.url, token=TOKEN, timeout=30)
    op.put_namespace("kv", PAGE)
    for i in range(100):
        op.put_page("kv", f"k{i}", data(f"k{i}"))
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(
        b"".join(
            orjson.dumps({"timestamp": i, "input_length": 1024, "hash_ids": [0, i]}) + b"\n"
            for i in range(5)
        )
    )
    rows = {}
    for extra in ((), ("--cost-from", p.url)):
        env = {**os.environ, "SIDECAR_TOKEN": TOKEN}
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "api.cli",
                "plan",
                str(trace),
                "--capacities",
                "4",
                "--page-bytes",
                "1000",
                "--json",
                *extra,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout.strip().splitlines()[-1])
        cost, row = res["cost"], res["rows"][0]
        assert row["node_bytes"] == round(
            4 * (1000 + cost["index_bytes_per_page"]) + cost["base_rss_bytes"]
        )
        assert 100 < cost["index_bytes_per_page"] < 2000
        assert "node bytes = pages x (page + " in out.stdout
        rows[bool(extra)] = cost
    assert rows[False]["base_rss_bytes"] == 0 and rows[True]["base_rss_bytes"] > 2**20
    assert rows[True]["source"].endswith("(100 pages)")


def test_pinned_pages_are_written_first_and_outlive_a_kill(spawn, tmp_path):
    """write_back keeps pages in the host pool only until evicted or flushed; a pin writes
    its pages at once, so a SIGKILL loses the others, never the pinned ones."""
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    args = (
        "--host-pool",
        "32MiB",
        "--data-dir",
        str(tmp_path / "data"),
        "--token-file",
        str(tok),
        "--write-policy",
        "write_back",
    )
    p = spawn(*args).wait_ready(TOKEN)
    op = SidecarClient(p.url, token=TOKEN, timeout=30)
    op.put_namespace("kv", PAGE)
    keys = [f"k{i}" for i in range(20)]
    for k in keys:
        op.put_page("kv", k, data(k))
    rc, got = ctl(p, "pin", "kv", *keys[:5])
    assert rc == 0 and (got["pinned"], got["queued_for_tiers"]) == (5, 5)
    wait_for(lambda: op.stats()["namespaces"]["kv"]["pages"]["file"] == 5)
    p.proc.kill()
    p.proc.wait()
    q = spawn(*args).wait_ready(TOKEN)
    op = SidecarClient(q.url, token=TOKEN, timeout=30)
    op.put_namespace("kv", PAGE)
    assert op.exists_each("kv", keys) == [True] * 5 + [False] * 15
    assert op.get_page("kv", "k0") == data("k0")
