"""Bounded requests (issue 11, item 6): while the largest allowed move and the largest
allowed JSON body run, the event loop keeps answering `/healthz` within 50 ms and the
server's own memory stays bounded. The sidecar is a real process, and so is the prober:
neither shares the GIL or the garbage collector of the process sending the load."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import orjson
import pytest

from api.engine.client import SidecarClient, SidecarError
from api.engine.shm import SharedBuffer
from api.wire import MAX_JSON_VALUES
from loadtest.kit.unix_http import UnixHTTPConnection
from sidecar.keys import MAX_BATCH
from sidecar.transports.base import MAX_RUNS

CHUNKS = MAX_RUNS // MAX_BATCH  # 16 runs a page: the largest request is 4,096 x 16
CHUNK = 1024
PAGE = CHUNKS * CHUNK
PROBE_LIMIT = 0.050
RSS_BOUND = 48 * 2**20  # the server's anonymous memory may grow this much at most


def layer_first(slots: int) -> list[dict]:
    """Chunk c of slot i at c * slots * CHUNK + i * CHUNK: no two runs of a page touch, so
    a request of 4,096 keys plans exactly 65,536 copies."""
    return [{"offset": c * slots * CHUNK, "stride": CHUNK, "size": CHUNK} for c in range(CHUNKS)]


def page_in(buf: SharedBuffer, slot: int) -> bytes:
    return b"".join(
        bytes(buf.view(c * MAX_BATCH * CHUNK + slot * CHUNK, CHUNK)) for c in range(CHUNKS)
    )


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


PROBE = """
import http.client, sys, time
port, pid = int(sys.argv[1]), sys.argv[2]
def rss():
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
print("ready", flush=True)
while True:
    t0 = time.perf_counter()
    conn.request("GET", "/healthz")
    resp = conn.getresponse()
    resp.read()
    print(resp.status, time.perf_counter() - t0, rss(), flush=True)
    time.sleep(0.005)
"""


class Prober:
    """GET /healthz every 5 ms from a process of its own; each latency and the server's
    anonymous RSS."""

    def __init__(self, port: int, pid: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, str(port), str(pid)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline() == "ready\n"

    def stop(self) -> tuple[list[float], list[int]]:
        self.proc.kill()
        lines = self.proc.communicate(timeout=30)[0].split("\n")
        rows = [line.split() for line in lines if line.count(" ") == 2]
        assert rows and all(r[0] == "200" for r in rows)
        return [float(r[1]) for r in rows], [int(r[2]) for r in rows]


def max_json_body() -> bytes:
    """A body at both limits: 4 MiB and just under MAX_JSON_VALUES values of ~128 bytes
    (4,096 real keys, padding the route ignores): the costliest parse a request may ask for."""
    keys = [f"{i:0128x}" for i in range(MAX_BATCH)]
    pad_n = MAX_JSON_VALUES - MAX_BATCH - 16
    pad = ["p" * ((4 * 2**20 - MAX_BATCH * 132 - 1024) // pad_n - 3)] * pad_n
    body = orjson.dumps({"keys": keys, "pad": pad})
    assert 4 * 2**20 - 64 * 1024 < len(body) <= 4 * 2**20
    return body


def raw_post(socket_path: str, path: str, body: bytes) -> int:
    """POST on the engine socket, where the namespace's owner asks (uid of this process)."""
    conn = UnixHTTPConnection(socket_path, timeout=60)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


def test_healthz_stays_fast_while_the_largest_requests_run(spawn):
    proc = spawn("--host-pool", "512MiB", "--no-file-tier", "--copy-threads", "2").wait_ready()
    client = SidecarClient(proc.socket_url, timeout=120)
    client.put_namespace("kv", PAGE)
    buf = SharedBuffer(MAX_BATCH * PAGE)
    buf.view(0, buf.size)[:] = os.urandom(buf.size)
    bid = buf.register(client, "kv", MAX_BATCH, layer_first(MAX_BATCH))
    slots = list(range(MAX_BATCH))
    with pytest.raises(SidecarError) as past:  # one copy more than MAX_RUNS: 413
        client.set("kv", [f"x{i}" for i in range(MAX_BATCH + 1)], bid, slots + [0])
    assert past.value.status == 413
    client.set("kv", [f"warm{i}" for i in range(MAX_BATCH)], bid, slots)  # first-touch faults
    json_body = max_json_body()
    lists = b'{"keys": [' + b"[]," * 400_000 + b"[]]}"  # 1.2 MB of 400,000 values: 413 unparsed
    base = rss_anon(proc.proc.pid)
    prober = Prober(proc.port, proc.proc.pid)
    results = []
    for r in range(4):
        keys = [f"r{r}-{i}" for i in range(MAX_BATCH)]
        first = page_in(buf, 0)  # what key r-0 is set from
        results.append(all(client.set("kv", keys, bid, slots)))
        results.append(all(client.get("kv", keys, bid, slots[::-1])))
        results.append(raw_post(proc.socket, "/v1/namespaces/kv/exists", json_body) == 200)
        results.append(raw_post(proc.socket, "/v1/namespaces/kv/exists", lists) == 413)
    latencies, rss = prober.stop()
    lat = sorted(latencies)
    over = [x for x in lat if x > PROBE_LIMIT]
    print(
        f"probes {len(lat)} median {statistics.median(lat) * 1e3:.1f} ms max {lat[-1] * 1e3:.1f} ms "
        f"over 50 ms {len(over)}; RssAnon +{(max(rss) - base) / 2**20:.1f} MiB"
    )
    assert all(results), results
    assert len(lat) >= 40
    # every probe within 50 ms, but a loaded 2-core machine deschedules the server or the
    # prober now and then (a 2-ms collection once took 490 ms): 1 probe in 20 may be over.
    # Before the fix, each of these moves stalled the loop 80-800 ms (11 of 76 probes over).
    assert statistics.median(lat) < PROBE_LIMIT / 5
    assert len(over) <= max(2, len(lat) // 20), over
    assert max(rss) - base < RSS_BOUND
    assert client.get("kv", ["r3-0"], bid, [7]) == [True]
    assert page_in(buf, 7) == first
    buf.close()
    client.close()


def test_a_batch_plans_at_most_max_runs_in_all(server, client, monkeypatch):
    from api.engine.shm import page_first_chunks
    from sidecar import hybrid

    monkeypatch.setattr(hybrid, "MAX_RUNS", 3)  # each item alone is within the cap
    buf = SharedBuffer(2 * 4096)
    items = []
    for name in ("kv", "mamba"):
        client.put_namespace(name, 4096)
        bid = buf.register(client, name, 2, page_first_chunks(4096))
        items.append({"namespace": name, "keys": ["a", "b"], "buffer_id": bid, "slots": [0, 1]})
    with pytest.raises(SidecarError) as e:
        client.batch_set(items)
    assert (e.value.status, e.value.code) == (413, "payload_too_large")
    assert client.exists("kv", ["a"]) == 0  # refused before anything moved
    assert client.batch_set(items[:1]) == {"kv": [True, True]}
    buf.close()
