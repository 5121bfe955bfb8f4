"""/ui, /v1/samples and /docs: offline assets, behind the token, and the sample ring."""

import re
import threading
import time

import pytest
import requests

from api.engine.shm import SharedBuffer, page_first_chunks
from sidecar.samples import Sampler

PAGE = 4096
EXTERNAL = re.compile(
    r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?(https?:)?//""", re.I
)


def stats(hits=0, misses=0, bytes_in=0, bytes_out=0, host=0, failed=0, corrupt=0, pending=0):
    """What `Store.sample()` answers."""
    return {
        "totals": {"hits": hits, "misses": misses, "bytes_in": bytes_in, "bytes_out": bytes_out},
        "fill": {"kv": host / 100},
        "pages": {"host": host, "file": 2 * host},
        "write_queue": {"pending": pending, "failed": failed, "dropped": 0},
        "tier_errors": corrupt,
    }


def test_sampler_turns_counters_into_rates():
    s = Sampler(size=3)
    first = s.add(stats(), now=100.0)
    assert first["hit_rate"] is None and first["gbps_in"] == 0 and first["errors"] == 0
    two = s.add(
        stats(
            hits=3, misses=1, bytes_in=4e9, bytes_out=2e9, host=50, corrupt=1, pending=7, failed=2
        ),
        {("GET", "/x", "500"): 2, ("GET", "/x", "200"): 9},
        now=102.0,
    )
    assert two["hit_rate"] == 0.75
    assert two["gbps_in"] == pytest.approx(2.0) and two["gbps_out"] == pytest.approx(1.0)
    assert two["fill"] == {"kv": 0.5} and two["pages"] == {"host": 50, "file": 100}
    assert two["write_queue"] == 7 and two["errors"] == 1 + 2 + 2
    idle = s.add(
        stats(hits=3, misses=1, bytes_in=4e9, bytes_out=2e9, host=50, corrupt=1, failed=2),
        {("GET", "/x", "500"): 2},
        now=103.0,
    )
    assert idle["hit_rate"] is None and idle["gbps_in"] == 0 and idle["errors"] == 0
    s.add(stats(), now=104.0)
    assert [x["t"] for x in s.ring] == [102.0, 103.0, 104.0]  # the oldest dropped
    assert [x["t"] for x in s.since(102.5)] == [103.0, 104.0]


def test_pages_are_behind_the_token_and_load_nothing_from_outside(make_server):
    srv = make_server(token="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    for path in (
        "/ui",
        "/docs",
        "/docs/swagger-ui-bundle.js",
        "/docs/swagger-ui.css",
        "/openapi.json",
        "/v1/samples",
    ):
        assert requests.get(srv.url + path, timeout=5).status_code == 401, path
        r = requests.get(srv.url + path, headers=auth, timeout=5)
        assert r.status_code == 200, path
    ui = requests.get(srv.url + "/ui", headers=auth, timeout=5).text
    docs = requests.get(srv.url + "/docs", headers=auth, timeout=5).text
    assert "<svg" not in ui and "createElementNS" in ui  # charts are drawn by the page's own script
    for page in (ui, docs):
        assert not EXTERNAL.search(page), EXTERNAL.search(page)
    assert 'src="/docs/swagger-ui-bundle.js"' in docs
    js = requests.get(srv.url + "/docs/swagger-ui-bundle.js", headers=auth, timeout=5)
    assert js.headers["content-type"].startswith("text/javascript") and len(js.content) > 100_000
    for bad in ("/docs/redoc.standalone.js", "/docs/..%2F__init__.py", "/docs/core.py"):
        assert requests.get(srv.url + bad, headers=auth, timeout=5).status_code == 404, bad
    assert requests.get(srv.url + "/v1/samples?since=x", headers=auth, timeout=5).status_code == 400


def traffic(client, stop: threading.Event, ns: str = "kv", rounds: int = 0) -> None:
    """Engine-shaped traffic until `stop` (or `rounds`): set pages, get them back, ask for
    absent ones."""
    buf = SharedBuffer(16 * PAGE)
    try:
        bid = buf.register(client, ns, 16, page_first_chunks(PAGE))
        i = 0
        while not stop.is_set() and not (rounds and i >= rounds):
            keys = [f"k{i}-{j}" for j in range(8)]
            client.set(ns, keys, bid, list(range(8)))
            asked = keys[: 8 - i % 5] + [f"absent{i}-{j}" for j in range(i % 7)]  # a varying mix
            client.get(ns, asked, bid, list(range(len(asked))))
            i += 1
    finally:
        buf.close()


def test_samples_follow_live_traffic(make_server):
    srv = make_server()
    client = srv.client()
    client.put_namespace("kv", PAGE, model="m")
    stop = threading.Event()
    t = threading.Thread(target=traffic, args=(client, stop))
    t.start()
    try:
        deadline, got = time.time() + 20, []
        while time.time() < deadline:
            got = [
                s
                for s in client.request("GET", "/v1/samples")[1]["samples"]  # its owner
                if s["hit_rate"] is not None
            ]
            if got and got[-1]["gbps_in"] > 0:
                break
            time.sleep(0.2)
    finally:
        stop.set()
        t.join(10)
    last = got[-1]
    assert 0 < last["hit_rate"] < 1 and last["gbps_in"] > 0 and last["gbps_out"] > 0
    assert 0 < last["fill"]["kv"] <= 1 and last["pages"]["host"] > 0
    anonymous = requests.get(srv.url + "/v1/samples", timeout=5).json()["samples"]
    assert anonymous and not any(s["fill"] for s in anonymous)  # another owner's: no name


def test_basic_login_takes_the_token_as_password(make_server):
    srv = make_server(token="s3cret")
    assert requests.get(srv.url + "/ui", auth=("sidecar", "s3cret"), timeout=5).status_code == 200
    assert (
        requests.get(srv.url + "/v1/stats", auth=("sidecar", "s3cret"), timeout=5).status_code
        == 200
    )
    for auth in (("sidecar", "wrong"), ("admin", "s3cret"), ("sidecar", "")):
        r = requests.get(srv.url + "/ui", auth=auth, timeout=5)
        assert r.status_code == 401 and 'Basic realm="kv-sidecar"' in r.headers["www-authenticate"]
