"""A real vLLM CPU engine saves and loads KV through a real sidecar (`make test-vllm`).

Two engine processes (about a minute each) carry every scenario:
  engine 1: A (miss, saves its full blocks and its tail), then B = A's first two blocks + new
            tokens (saves B's new blocks and tail)
  engine 2: A with vLLM's prefix cache emptied -> loaded from the sidecar, every token but the
            last, same greedy tokens;
            the sidecar restarts on its data dir -> A loads again, same tokens;
            B's new pages corrupted on disk -> a miss for those blocks, recomputed (same
            tokens) and saved again.
"""

from __future__ import annotations

import glob
import os
import random
import time

from api.engine.client import SidecarClient
from loadtest.kit.procs import free_port

BLOCK = 32
TOKEN = "vllm-test-token"


def prompts() -> tuple[list[int], list[int]]:
    r = random.Random(7)
    a = [r.randrange(2, 1024) for _ in range(101)]  # 3 full blocks + 5 tokens
    b = a[: 2 * BLOCK] + [r.randrange(2, 1024) for _ in range(70)]  # 4 full blocks + 6
    return a, b


def pages(data_dir: str) -> set[str]:
    return set(glob.glob(os.path.join(data_dir, "**", "*.pg"), recursive=True))


def settled(data_dir: str, n: int, timeout: float = 30.0) -> set[str]:
    """The page files once `n` are there (sets run on the worker's I/O thread)."""
    deadline = time.monotonic() + timeout
    while len(found := pages(data_dir)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def corrupt(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def file_stats(url: str) -> dict:
    return SidecarClient(url, token=TOKEN).stats()["tiers"]["file"]


def test_engines_share_kv_through_the_sidecar(spawn, engines, tiny_model, tmp_path):
    data = str(tmp_path / "sidecar-data")
    port = free_port()
    args = ("--data-dir", data, "--host-pool", "64MiB", "--token", TOKEN, "--log-level", "warning")
    sidecar = spawn(*args, port=port).wait_ready(TOKEN)
    a, b = prompts()

    # engine 1: computes everything, saves through the sidecar
    e1 = engines(tiny_model, sidecar.socket_url, TOKEN)
    ref_a = e1.ask(op="generate", prompts=[a])
    assert ref_a["cached"] == [0]
    before_b = settled(data, 4)
    assert len(before_b) == 4, "A's 3 full computed blocks and its tail, each saved once"
    ref_b = e1.ask(op="generate", prompts=[b])
    assert e1.close() == 0
    b_pages = settled(data, 7) - before_b
    assert len(b_pages) == 3, "B's blocks 2 and 3 and its tail (0 and 1 are A's)"

    # engine 2: a new process loads A's prefix from the sidecar
    e2 = engines(tiny_model, sidecar.socket_url, TOKEN)
    got = e2.ask(op="generate", prompts=[a], reset=True)
    assert got["cached"] == [len(a) - 1]  # 3 blocks and the tail: all but the last token
    assert got["tokens"] == ref_a["tokens"]

    # the sidecar restarts on its data dir: A is still there
    code, _ = sidecar.terminate()
    assert code == 0
    sidecar = spawn(*args, port=port, socket=sidecar.socket).wait_ready(TOKEN)
    got = e2.ask(op="generate", prompts=[a], reset=True)
    assert got["cached"] == [len(a) - 1]
    assert got["tokens"] == ref_a["tokens"]

    # B's own pages corrupted on disk: they fail to load, vLLM recomputes them
    for path in b_pages:
        corrupt(path)
    got = e2.ask(op="generate", prompts=[b], reset=True)
    assert got["tokens"] == ref_b["tokens"]
    assert file_stats(sidecar.url)["corrupt"] >= 1
    # the sidecar dropped the corrupt files; the recomputed blocks (and tail) are saved again
    assert len(settled(data, 7)) == 7
    assert e2.close() == 0
