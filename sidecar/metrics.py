"""Prometheus exposition. Counters live in plain ints on the hot path; a scrape copies them
on the event loop (`snapshot`, a few ms with 4,096 namespaces) and renders the text in a
thread (`render`: the part that grew with namespaces and stalled the loop 1.6 s with
20,000 of them), so serving a page costs no metrics lock and a scrape no stall."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from sidecar import report

if TYPE_CHECKING:
    from sidecar.store import Store

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RequestStats:
    """Requests by (method, route, status) and latency histograms by route."""

    __slots__ = ("count", "hist", "sums")

    def __init__(self) -> None:
        self.count: Counter = Counter()
        self.hist: dict[str, list[int]] = {}
        self.sums: defaultdict[str, float] = defaultdict(float)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.count[(method, route, str(status))] += 1
        buckets = self.hist.get(route)
        if buckets is None:
            buckets = self.hist[route] = [0] * (len(BUCKETS) + 1)
        i = 0
        while i < len(BUCKETS) and seconds > BUCKETS[i]:
            i += 1
        buckets[i] += 1
        self.sums[route] += seconds


def snapshot(store: Store, requests: RequestStats, who: Any) -> dict:
    """Everything one scrape shows, copied on the event loop (the namespaces `who` reaches)."""
    return {
        "count": dict(requests.count),
        "hist": {r: list(b) for r, b in requests.hist.items()},
        "sums": dict(requests.sums),
        "stats": report.stats(store, who),
        "tiers": [
            (t.name, t.counters(), bool(t.describe().get("degraded"))) for t in store.tiering.tiers
        ],
    }


class _Collector:
    def __init__(self, snap: dict):
        self.snap = snap

    def collect(self) -> Iterator:
        yield from self._requests()
        stats = self.snap["stats"]
        yield from self._namespaces(stats)
        yield from self._tiers(stats)
        yield from self._tier_events()
        yield from self._cost(stats)

    def _cost(self, stats: dict) -> Iterator:
        """What a cached page and token cost (sidecar/cost.py), and the pins held."""
        node = stats["cost"]["node"]
        fam = GaugeMetricFamily(
            "kv_sidecar_cost_bytes",
            "bytes a stored page or token costs (host pool nominal, index, RSS)",
            labels=["per", "kind"],
        )
        for per in ("page", "token"):
            for kind, v in node[f"per_{per}"].items():
                if v is not None:
                    fam.add_metric([per, kind.removesuffix("_bytes")], v)
        rss = GaugeMetricFamily("kv_sidecar_rss_bytes", "resident memory of the sidecar")
        rss.add_metric([], node["rss_bytes"])
        index = GaugeMetricFamily("kv_sidecar_index_bytes", "Python objects indexing the pages")
        index.add_metric([], node["index_bytes"])
        pins = GaugeMetricFamily("kv_sidecar_pinned_pages", "operator pins", labels=["namespace"])
        for name, ns in stats["controls"]["namespaces"].items():
            pins.add_metric([name], ns["pages"])
        yield from (fam, rss, index, pins)

    def _tier_events(self) -> Iterator:
        """Every tier's event counters (writes, reads, errors, misses by cause)."""
        events = CounterMetricFamily(
            "kv_sidecar_tier_events", "tier events by kind", labels=["tier", "event"]
        )
        degraded = GaugeMetricFamily(
            "kv_sidecar_tier_degraded", "1 while the tier reports a failure", labels=["tier"]
        )
        for name, counters, is_degraded in self.snap["tiers"]:
            for event, n in counters.items():
                events.add_metric([name, event], n)
            degraded.add_metric([name], 1 if is_degraded else 0)
        yield from (events, degraded)

    def _requests(self) -> Iterator:
        req = CounterMetricFamily(
            "kv_sidecar_requests", "HTTP requests", labels=["method", "route", "status"]
        )
        counts = self.snap["count"]
        for (method, route, status), n in sorted(counts.items()):
            req.add_metric([method, route, status], n)
        # a zero 500 beside each route without a 5xx: error panels read 0, never "no data"
        failed = {(m, r) for m, r, s in counts if s.startswith("5")}
        for method, route in sorted({(m, r) for m, r, _ in counts} - failed):
            req.add_metric([method, route, "500"], 0)
        yield req
        lat = HistogramMetricFamily(
            "kv_sidecar_request_seconds", "request latency", labels=["route"]
        )
        for route, counts in sorted(self.snap["hist"].items()):
            acc, buckets = 0, []
            for bound, n in zip([*map(str, BUCKETS), "+Inf"], counts, strict=True):
                acc += n
                buckets.append((bound, acc))
            lat.add_metric([route], buckets, self.snap["sums"][route])
        yield lat

    def _namespaces(self, stats: dict) -> Iterator:
        hp = stats["host_pool"]
        host = GaugeMetricFamily("kv_sidecar_host_pool_bytes", "host pool size", labels=["state"])
        host.add_metric(["total"], hp["bytes"])
        host.add_metric(["free"], hp["free_segments"] * hp["segment_size"])
        yield host
        pages = GaugeMetricFamily("kv_sidecar_pages", "pages stored", labels=["namespace", "tier"])
        cap = GaugeMetricFamily(
            "kv_sidecar_capacity_pages", "page capacity", labels=["namespace", "tier"]
        )
        fams = {
            k: CounterMetricFamily(f"kv_sidecar_{k}", f"{k} per namespace", labels=["namespace"])
            for k in (
                "hits",
                "misses",
                "evictions",
                "stored",
                "no_room",
                "tier_hits",
                "restores_skipped",
                "restore_pages_skipped",
            )
        }
        moved = CounterMetricFamily(
            "kv_sidecar_bytes", "bytes moved", labels=["namespace", "direction"]
        )
        for name, ns in stats["namespaces"].items():
            for tier, n in ns["pages"].items():
                pages.add_metric([name, tier], n)
            cap.add_metric([name, "host"], ns["capacity_pages"])
            for k, fam in fams.items():
                fam.add_metric([name], ns[k])
            moved.add_metric([name, "in"], ns["bytes_in"])
            moved.add_metric([name, "out"], ns["bytes_out"])
        yield from (pages, cap, *fams.values(), moved)

    def _tiers(self, stats: dict) -> Iterator:
        io = CounterMetricFamily(
            "kv_sidecar_tier_bytes",
            "bytes written to and read from each tier",
            labels=["tier", "direction"],
        )
        errors = CounterMetricFamily(
            "kv_sidecar_tier_errors", "failed tier I/O and corrupt pages", labels=["tier", "kind"]
        )
        for name, t in stats["tiers"].items():
            io.add_metric([name, "write"], t["bytes_written"])
            io.add_metric([name, "read"], t["bytes_read"])
            for kind in ("write_errors", "read_errors", "corrupt"):
                errors.add_metric([name, kind.removesuffix("_errors")], t[kind])
        wq = stats["write_queue"]
        queue = GaugeMetricFamily("kv_sidecar_write_queue_pages", "pages queued for the tiers")
        queue.add_metric([], wq["pending"])
        lost = CounterMetricFamily(
            "kv_sidecar_write_queue_lost",
            "queued tier writes that failed or were dropped",
            labels=["reason"],
        )
        lost.add_metric(["failed"], wq["failed"])
        lost.add_metric(["dropped"], wq["dropped"])
        yield from (io, errors, queue, lost)


def render(snap: dict) -> bytes:
    """The Prometheus text format of a `snapshot` (in a thread: no state of the loop's)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snap))
    return generate_latest(registry)
