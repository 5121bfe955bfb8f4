"""Two `vllm serve` OpenAI servers and one sidecar (issue 44), with deploy/engine-vllm.yaml's
flags (bench_serve_lib.serve_args) and the tiny model; one fleet for the module.

  restore:  server 2 restores server 1's prefix: usage.prompt_tokens_details.cached_tokens
            is every token but the last, vLLM's external_kv_transfer counter moved, and the
            greedy tokens are server 1's
  SIGKILL:  the sidecar is killed while both servers are under load: every request answers
            200 (misses); restarted on its data dir, a prefix stored before the kill is
            restored again
"""

from __future__ import annotations

import glob
import os
import random
import threading
import time

import pytest

from api.engine.client import SidecarClient
from loadtest.kit.procs import SidecarProcess
from loadtest.serving import fleet as fl
from loadtest.serving import lib as sl

TOKEN = "serve-test-token"
SIDECAR_ARGS = ("--host-pool", "64MiB", "--token", TOKEN, "--log-level", "warning")


def prompt(seed: int, n: int = 101) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(2, 1024) for _ in range(n)]


def stored(sidecar: SidecarProcess) -> int:
    stats = SidecarClient(sidecar.url, token=TOKEN).stats()
    return sum(ns["stored"] for ns in stats["namespaces"].values())


def until_stored(sidecar: SidecarProcess, n: int, timeout: float = 60) -> None:
    """Saves run on the worker's I/O thread after the answer: wait until n pages are in."""
    deadline = time.monotonic() + timeout
    while stored(sidecar) < n:
        assert time.monotonic() < deadline, f"{stored(sidecar)} pages stored, want {n}"
        time.sleep(0.05)


def until_on_disk(data: str, n: int, timeout: float = 60) -> None:
    """The file tier writes behind the host pool: wait until n page files are there."""
    deadline = time.monotonic() + timeout
    while len(glob.glob(os.path.join(data, "**", "*.pg"), recursive=True)) < n:
        assert time.monotonic() < deadline, f"fewer than {n} page files in {data}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    data = str(tmp_path_factory.mktemp("serve-sidecar"))
    sidecar = SidecarProcess("--data-dir", data, *SIDECAR_ARGS).wait_ready(TOKEN)
    conn = sl.sidecar_connector(sidecar.socket_url)
    conn["kv_connector_extra_config"]["sidecar_token"] = TOKEN
    # restores are what this test counts: on the tiny model a file-tier restore after the
    # restart can cost more than its prefill, and the rule (test_restore_cost.py) skips it
    conn["kv_connector_extra_config"]["restore_cost"] = False
    servers = [fl.Server(tiny_model, conn, fl.sizing(512, 16 << 20)) for _ in range(2)]
    state = {"sidecar": sidecar, "servers": servers, "data": data}
    try:
        for s in servers:
            s.wait()
        yield state
    finally:
        for s in servers:
            s.stop()
        state["sidecar"].kill()  # the one running now (a test restarts it)


def test_second_server_restores_the_firsts_prefix(fleet):
    s1, s2 = fleet["servers"]
    a = prompt(1)
    ref = s1.complete(a, 8)
    assert ref["status"] == 200 and len(ref["tokens"]) == 8
    until_stored(fleet["sidecar"], 4)  # 3 full blocks and the tail
    before = s2.prompt_tokens()
    got = s2.complete(a, 8)
    assert got["status"] == 200
    assert got["cached_tokens"] == len(a) - 1, (
        "every token but the last restored over the OpenAI API"
    )
    assert got["tokens"] == ref["tokens"], "the same greedy text"
    moved = s2.prompt_tokens()["external_kv_transfer"] - before["external_kv_transfer"]
    assert moved == len(a) - 1


def load(
    servers: list, stop: threading.Event, results: list, done: threading.Condition, seed: int
) -> None:
    """Unique prompts, round-robin over the servers, until `stop`; each result recorded."""
    k = 0
    while not stop.is_set():
        got = servers[k % len(servers)].complete(prompt(seed * 1000 + k, 70), 2, timeout=120)
        with done:
            results.append(got)
            done.notify_all()
        k += 1


def test_sidecar_killed_under_load_then_hits_come_back(fleet):
    s1, s2 = fleet["servers"]
    kept = [prompt(50 + i) for i in range(3)]
    for p in kept:
        assert s1.complete(p, 4)["status"] == 200
    until_on_disk(fleet["data"], 4 * 3 + 4)  # A's 4 and the 3 kept prompts' 4 each
    ref = [s1.complete(p, 4)["tokens"] for p in kept]  # vLLM's own cache: the same greedy run
    results: list[dict] = []
    done, stop = threading.Condition(), threading.Event()
    workers = [
        threading.Thread(target=load, args=([s1, s2], stop, results, done, 7 + i)) for i in range(2)
    ]
    for w in workers:
        w.start()
    try:
        with done:
            assert done.wait_for(lambda: len(results) >= 2, timeout=300)
        fleet["sidecar"].kill()  # SIGKILL under load
        killed_at = len(results)
        with done:
            assert done.wait_for(lambda: len(results) >= killed_at + 6, timeout=300)
    finally:
        stop.set()
        for w in workers:
            w.join(300)
    assert [r["status"] for r in results] == [200] * len(results), [r.get("error") for r in results]
    assert all(len(r["tokens"]) == 2 for r in results)

    old = fleet["sidecar"]
    fleet["sidecar"] = SidecarProcess(
        "--data-dir", fleet["data"], *SIDECAR_ARGS, port=old.port, socket=old.socket
    ).wait_ready(TOKEN)
    hits = []
    for p, want in zip(kept, ref, strict=True):  # never sent to server 2 before
        got = s2.complete(p, 4)
        assert got["status"] == 200 and got["tokens"] == want
        hits.append(got["cached_tokens"])
    # the first call after the restart may re-register the connector's namespace and miss
    assert hits[-1] == len(kept[-1]) - 1, f"cached tokens after the restart: {hits}"
