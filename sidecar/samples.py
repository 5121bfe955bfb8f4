"""A short ring of status samples for the `/ui` page: `Store.stats()` once a second, turned
into the rates a person reads (hit rate, GB/s) by differencing consecutive counters.

    ring: [s(t-599) s(t-598) ... s(t)]    one sample a second, the oldest dropped

Each sample:
    {"t": unix seconds, "hit_rate": 0..1 | None (no lookups), "gbps_in", "gbps_out",
     "fill": {namespace: host pages / capacity}, "pages": {tier: pages},
     "write_queue": pending pages, "errors": new errors this interval (tier I/O, corrupt,
     dropped or failed writes, 5xx answers)}
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable, Optional

log = logging.getLogger("kv_sidecar")
INTERVAL = 1.0
RING = 600  # ten minutes at one sample a second


def totals(stats: dict, requests: Optional[dict] = None) -> dict[str, float]:
    """The monotonic counters a sample is the difference of."""
    spaces = stats["namespaces"].values()
    wq = stats["write_queue"]
    errors = wq["failed"] + wq["dropped"]
    for tier in stats["tiers"].values():
        errors += tier.get("write_errors", 0) + tier.get("read_errors", 0) + tier.get("corrupt", 0)
    errors += sum(n for (_, _, status), n in (requests or {}).items() if status.startswith("5"))
    return {"hits": sum(ns["hits"] for ns in spaces), "misses": sum(ns["misses"] for ns in spaces),
            "bytes_in": sum(ns["bytes_in"] for ns in spaces),
            "bytes_out": sum(ns["bytes_out"] for ns in spaces), "errors": errors}


def gauges(stats: dict) -> dict[str, Any]:
    """What a sample shows as is: pool fill per namespace, pages per tier, the write queue."""
    fill, pages = {}, {}
    for name, ns in stats["namespaces"].items():
        fill[name] = ns["pages"].get("host", 0) / ns["capacity_pages"] if ns["capacity_pages"] else 0.0
        for tier, n in ns["pages"].items():
            pages[tier] = pages.get(tier, 0) + n
    return {"fill": fill, "pages": pages, "write_queue": stats["write_queue"]["pending"]}


class Sampler:
    """The ring, and the background task that fills it (`run`, started by the Context)."""

    def __init__(self, size: int = RING):
        self.ring: deque[dict] = deque(maxlen=size)
        self._last: Optional[tuple[float, dict]] = None

    def add(self, stats: dict, requests: Optional[dict] = None, now: Optional[float] = None) -> dict:
        now = time.time() if now is None else now
        cur = totals(stats, requests)
        sample: dict[str, Any] = {"t": round(now, 3), **gauges(stats)}
        if self._last is None:
            sample.update(hit_rate=None, gbps_in=0.0, gbps_out=0.0, errors=0)
        else:
            t0, prev = self._last
            d = {k: cur[k] - prev[k] for k in cur}
            dt = max(now - t0, 1e-6)
            looked = d["hits"] + d["misses"]
            sample.update(hit_rate=d["hits"] / looked if looked else None,
                          gbps_in=d["bytes_in"] / dt / 1e9, gbps_out=d["bytes_out"] / dt / 1e9,
                          errors=d["errors"])
        self._last = (now, cur)
        self.ring.append(sample)
        return sample

    def since(self, t: float = 0.0) -> list[dict]:
        return [s for s in self.ring if s["t"] > t]

    async def run(self, stats: Callable[[], dict], requests: Callable[[], dict],
                  interval: float = INTERVAL) -> None:
        while True:
            try:
                self.add(stats(), requests())
            except Exception:  # a sample is never worth the sidecar: log, go on
                log.exception("status sample failed")
            await asyncio.sleep(interval)
