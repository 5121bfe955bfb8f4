"""docs/grafana-dashboard.json asks only for metrics, and labels, a live sidecar exports."""

import json
import os
import re
import threading

import requests

from tests.api.test_ui import traffic
from tests.conftest import ROOT

DASHBOARD = os.path.join(ROOT, "docs", "grafana-dashboard.json")
METRIC = re.compile(r"\b(kv_sidecar_[a-z_]+)(\{[^}]*\})?")
FUNCS_AND_KEYWORDS = {"by", "le", "job"}  # `job` is added by Prometheus at scrape time


def exprs() -> list[str]:
    with open(DASHBOARD) as f:
        dash = json.load(f)
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def scrape(text: str) -> dict[str, set[str]]:
    """Sample name -> label names seen on it."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?", line)
        labels = set(re.findall(r'([a-zA-Z_]\w*)="', m.group(3) or ""))
        out.setdefault(m.group(1), set()).update(labels)
    return out


def test_dashboard_covers_what_operators_watch():
    with open(DASHBOARD) as f:
        titles = " ".join(p["title"].lower() for p in json.load(f)["panels"])
    for topic in ("hit rate", "fill", "tier", "errors", "latency"):
        assert topic in titles, topic
    for e in exprs():
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e


def test_every_metric_the_dashboard_names_is_exported(make_server, tmp_path):
    srv = make_server(file_tier=True, data_dir=str(tmp_path / "tier"))
    client = srv.client()
    client.put_namespace("kv", 4096, model="m")
    traffic(client, threading.Event(), rounds=3)  # sets, gets with hits and misses
    assert requests.post(srv.url + "/v1/flush", timeout=30).json()["pending"] == 0
    exported = scrape(client.metrics())
    named = {}
    for e in exprs():
        for name, matcher in METRIC.findall(e):
            named.setdefault(name, set()).update(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)", matcher))
        for by in re.findall(r"by \(([^)]*)\)", e):
            for metric in METRIC.findall(e):
                named[metric[0]].update(x.strip() for x in by.split(","))
    missing = sorted(n for n in named if n not in exported)
    assert missing == [], f"the dashboard names metrics the sidecar does not export: {missing}"
    for name, labels in named.items():
        unknown = labels - exported[name] - FUNCS_AND_KEYWORDS
        assert not unknown, f"{name}: labels {unknown} are not exported ({exported[name]})"
    assert {
        "kv_sidecar_tier_bytes_total",
        "kv_sidecar_write_queue_pages",
        "kv_sidecar_request_seconds_bucket",
    } <= set(named)
