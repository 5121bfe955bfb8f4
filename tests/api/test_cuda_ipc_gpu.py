"""CUDA IPC end to end (needs a GPU; skipped cleanly without one)."""

import os
import subprocess
import sys
import time

import orjson
import pytest

from api.engine.client import SidecarClient
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


# legacy CUDA IPC shares cudaMalloc memory only: keep torch off expandable segments
ENV = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}


def engine(url, op, layout, pages=8, ns="gpu-kv"):
    out = subprocess.run(
        [sys.executable, "-m", "tests.api.cuda_engine_proc", url, ns, op, layout, str(pages)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return orjson.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_gpu_pages_round_trip_between_engine_processes(spawn, layout):
    p = spawn("--host-pool", "1GiB", "--no-file-tier").wait_ready()
    c = SidecarClient(p.socket_url)
    assert c.stats()["cuda_host_registered"] is True
    wrote = engine(p.socket_url, "set", layout, ns=f"gpu-{layout}")
    read = engine(p.socket_url, "get", layout, ns=f"gpu-{layout}")
    assert wrote["ok"] and read["ok"] and wrote["digest"] == read["digest"]
    assert len(set(wrote["pages"])) == len(wrote["pages"])  # the pages differ from each other


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_one_page_of_one_process_restored_into_anothers_slot(spawn, layout):
    """Page 3 of engine 1's device tensors lands in slot 0 of engine 2's, byte-exact, and
    nothing else of engine 2's buffer is written."""
    p = spawn("--host-pool", "1GiB", "--no-file-tier").wait_ready()
    wrote = engine(p.socket_url, "set", layout, ns=f"one-{layout}")
    read = engine(p.socket_url, "one", layout, ns=f"one-{layout}")
    assert wrote["ok"] and read["ok"]
    assert read["pages"][0] == wrote["pages"][3]
    assert len(set(read["pages"][1:])) == 1 and read["pages"][1] != wrote["pages"][3]  # still zeros


def test_killed_engine_releases_its_handles(spawn):
    p = spawn("--host-pool", "1GiB", "--no-file-tier").wait_ready()
    c = SidecarClient(p.socket_url)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.api.cuda_engine_proc",
            p.socket_url,
            "gpu-kv",
            "hold",
            "page_first",
            "4",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    orjson.loads(proc.stdout.readline())
    assert c.stats()["namespaces"]["gpu-kv"]["buffers"] == 1
    proc.kill()
    proc.wait()
    deadline = time.time() + 15
    while c.stats()["namespaces"]["gpu-kv"]["buffers"] and time.time() < deadline:
        time.sleep(0.2)
    assert c.stats()["namespaces"]["gpu-kv"]["buffers"] == 0
    assert engine(p.socket_url, "set", "page_first", ns="gpu-kv")["ok"]  # others are still served
