"""A real Prometheus (Debian's `prometheus`; `make prometheus` installs it as root with apt)
scrapes a live sidecar under traffic through the job in deploy/prometheus-scrape.yml, then
every PromQL expression of docs/grafana-dashboard.json is asked through its HTTP API and
must return data. Skipped without the binary."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time

import pytest
import requests
import yaml

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.procs import free_port
from tests.api.test_grafana import exprs
from tests.conftest import ROOT

PROMETHEUS = shutil.which("prometheus")
TOKEN = "pr0m-t0ken"
PAGE = 4096
RATE = "10s"  # $__rate_interval: at least 4 scrapes of 1 s, as Grafana picks it
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (make prometheus)"),
]


def scrape_config(port: int, token_file: str) -> dict:
    """deploy/prometheus-scrape.yml with the pod discovery replaced by one static target
    carrying the labels Kubernetes discovery gives the DaemonSet's pod (its annotations)."""
    with open(os.path.join(ROOT, "deploy", "prometheus-scrape.yml")) as f:
        config = yaml.safe_load(f)
    with open(os.path.join(ROOT, "deploy", "kv-sidecar.yaml")) as f:
        ds = next(d for d in yaml.safe_load_all(f) if d["kind"] == "DaemonSet")
    notes = ds["spec"]["template"]["metadata"]["annotations"]
    labels = {
        "__meta_kubernetes_pod_annotation_" + k.replace(".", "_").replace("/", "_"): v
        for k, v in notes.items()
    }
    labels.update(
        {
            "__meta_kubernetes_pod_annotation_prometheus_io_port": str(port),
            "__meta_kubernetes_pod_ip": "127.0.0.1",
            "__meta_kubernetes_pod_node_name": "node-a",
        }
    )
    job = config["scrape_configs"][0]
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": ["pod.invalid:1"], "labels": labels}]
    job["scrape_interval"] = "1s"
    job["authorization"]["credentials_file"] = token_file
    return config


def query(base: str, promql: str) -> list:
    r = requests.get(base + "/api/v1/query", params={"query": promql}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (promql, body)
    return body["data"]["result"]


def traffic(url: str, stop: threading.Event) -> None:
    """Sets, gets with hits and misses, paced (the machine is shared)."""
    client = SidecarClient(url, token=TOKEN)
    buf = SharedBuffer(16 * PAGE)
    try:
        bid = buf.register(client, "kv", 16, page_first_chunks(PAGE))
        i = 0
        while not stop.wait(0.02):
            keys = [f"k{i}-{j}" for j in range(8)]
            client.set("kv", keys, bid, list(range(8)))
            asked = keys[: 8 - i % 5] + [f"absent{i}-{j}" for j in range(i % 7)]
            client.get("kv", asked, bid, list(range(len(asked))))
            i += 1
    finally:
        buf.close()


@pytest.fixture
def prometheus(tmp_path, spawn):
    """(the Prometheus API's base URL, the sidecar) with traffic running."""
    srv = spawn(
        "--host-pool", "64MiB", "--data-dir", str(tmp_path / "tier"), env={"SIDECAR_TOKEN": TOKEN}
    ).wait_ready(TOKEN)
    SidecarClient(srv.socket_url, token=TOKEN).put_namespace("kv", PAGE, model="m")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(srv.port, str(token_file))))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 (Prometheus writes it until it exits)
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    stop = threading.Event()
    t = threading.Thread(target=traffic, args=(srv.socket_url, stop), daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}", srv
    finally:
        stop.set()
        t.join(30)
        proc.terminate()
        proc.wait(30)
        log.close()


def wait_for_samples(base: str, timeout: float = 60) -> None:
    """Until the target is up and a rate window holds several scrapes of live traffic."""
    deadline, want = time.time() + timeout, f'count_over_time(up{{job="kv-sidecar"}}[{RATE}]) >= 5'
    while time.time() < deadline:
        try:
            ready = requests.get(base + "/-/ready", timeout=5).status_code == 200
        except requests.ConnectionError:  # not listening yet
            ready = False
        if (
            ready
            and query(base, want)
            and query(base, f"increase(kv_sidecar_hits_total[{RATE}]) > 0")
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"no samples: {query(base, 'up')}")


def test_every_dashboard_query_returns_data(prometheus):
    base, _ = prometheus
    wait_for_samples(base)
    # the deploy job's relabelling: the pod IP and port annotation, the node label
    assert query(base, 'up{job="kv-sidecar", node="node-a", instance=~"127.0.0.1:.*"} == 1')
    r = requests.get(
        base + "/api/v1/label/job/values",
        params={"match[]": "kv_sidecar_requests_total"},
        timeout=10,
    ).json()
    assert "kv-sidecar" in r["data"]  # the dashboard's $job variable
    empty, nan = [], []
    for e in exprs():
        promql = e.replace("$__rate_interval", RATE).replace('=~"$job"', '=~".*"')
        assert "$" not in promql, promql
        result = query(base, promql)
        if not result:
            empty.append(e)
        elif not any(math.isfinite(float(s["value"][1])) for s in result):
            nan.append(e)
    assert empty == [], "dashboard queries without data:\n" + "\n".join(empty)
    assert nan == [], "dashboard queries with no finite value:\n" + "\n".join(nan)


def test_labelled_metrics_exist_before_any_event(prometheus):
    """Series of what may never happen (a 5xx on each route asked, tier errors, lost
    writes, refused sets) are scraped from the start, as zeros until it does: their panels
    read 0 rather than "no data". (No request fails here: those stay 0.)"""
    base, _ = prometheus
    wait_for_samples(base)
    for promql in (
        "kv_sidecar_tier_errors_total",
        "kv_sidecar_write_queue_lost_total",
        "kv_sidecar_no_room_total",
        'kv_sidecar_requests_total{status=~"5.."}',
    ):
        assert query(base, promql), promql
    # (/readyz answers 503 until the tiers are recovered: the start-up polls)
    fives = query(base, 'kv_sidecar_requests_total{status=~"5..", route!="/readyz"} > 0')
    assert fives == [], [
        (s["metric"]["method"], s["metric"]["route"], s["metric"]["status"]) for s in fives
    ]
    routes = {s["metric"]["route"] for s in query(base, 'kv_sidecar_requests_total{status="500"}')}
    assert {"/metrics", "/v1/namespaces/{name}/set", "/v1/namespaces/{name}/get"} <= routes, routes
    tiers = {
        (s["metric"]["tier"], s["metric"]["kind"])
        for s in query(base, "kv_sidecar_tier_errors_total")
    }
    assert {("file", "write"), ("file", "read"), ("file", "corrupt")} <= tiers, tiers
