"""Engine processes sharing pages through the sidecar, dead engines, many concurrent clients."""

import hashlib
import subprocess
import sys
import threading
import time

import orjson
import pytest

from api.engine.shm import SharedBuffer, page_first_chunks
from tests.conftest import ROOT

PAGE = 8192


def engine(server, op, *keys, ns="kv"):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.api.engine_proc",
            server.socket_url,
            ns,
            op,
            str(PAGE),
            *keys,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return orjson.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
def test_two_engine_processes_share_pages(server, client):
    client.put_namespace("kv", PAGE)
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(24)]
    assert engine(server, "set", *keys) == {"result": [True] * 24, "ok": True}
    got = engine(server, "get", *keys)
    assert got["ok"] and got["result"] == [True] * 24
    # the writer's buffer is gone with its process, the pages stay
    server.invariants()
    assert client.exists("kv", keys) == 24


@pytest.mark.slow
def test_dead_engine_buffer_is_released(server, client):
    client.put_namespace("kv", PAGE)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.api.engine_proc",
            server.socket_url,
            "kv",
            "hold",
            str(PAGE),
            "a",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    bid = orjson.loads(proc.stdout.readline())["buffer_id"]
    assert client.stats()["namespaces"]["kv"]["buffers"] == 1
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while client.stats()["namespaces"]["kv"]["buffers"] and time.time() < deadline:
        time.sleep(0.1)
    assert client.stats()["namespaces"]["kv"]["buffers"] == 0
    ids = [b["buffer_id"] for b in client.request("GET", "/v1/namespaces/kv/buffers")[1]["buffers"]]
    assert bid not in ids
    assert engine(server, "set", "b")["ok"]  # the sidecar keeps serving others


def test_many_concurrent_clients_never_mix_pages(server):
    """8 threads, each its own connection and buffer, over overlapping keys: every page read
    back must be the bytes of its key (content is a function of the key)."""
    server.client().put_namespace("kv", PAGE, host_capacity_bytes=64 * PAGE)
    errors, rounds = [], 25

    def worker(w):
        c = server.client()
        buf = SharedBuffer(16 * PAGE)
        try:
            bid = buf.register(c, "kv", 16, page_first_chunks(PAGE))
            for r in range(rounds):
                keys = [f"k{(w * 7 + r * 3 + i) % 96}" for i in range(8)]
                for i, k in enumerate(keys):
                    buf.view(i * PAGE, PAGE)[:] = hashlib.shake_256(k.encode()).digest(PAGE)
                c.set("kv", keys, bid, list(range(8)))
                loaded = c.get("kv", keys, bid, list(range(8, 16)))
                for i, (k, ok) in enumerate(zip(keys, loaded, strict=True)):
                    if ok and buf.view((8 + i) * PAGE, PAGE) != hashlib.shake_256(
                        k.encode()
                    ).digest(PAGE):
                        errors.append(f"worker {w} round {r}: {k} came back with wrong bytes")
                page = c.get_page("kv", keys[0])
                if page is not None and page != hashlib.shake_256(keys[0].encode()).digest(PAGE):
                    errors.append(f"inline {keys[0]} wrong")
        except Exception as exc:  # surfaced below
            errors.append(repr(exc))
        finally:
            buf.close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker is still running after 120 s"
    assert errors == []
    server.invariants()
    stats = server.client().stats()["namespaces"]["kv"]
    assert stats["pages"]["host"] <= 64 and stats["hits"] > 0
