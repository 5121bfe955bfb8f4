"""A short ring of status samples for the `/ui` page: `Store.sample()` once a second (the
totals, pages per tier, the write queue and the largest namespaces' fill: no walk of every
namespace's counters, so 4,096 namespaces cost the loop what 4 do), turned into the rates
a person reads (hit rate, GB/s) by differencing consecutive counters.

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
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kv_sidecar")
INTERVAL = 1.0
RING = 600  # ten minutes at one sample a second


def totals(stats: dict, requests: dict | None = None) -> dict[str, float]:
    """The monotonic counters a sample is the difference of (`stats`: `Store.sample()`)."""
    wq = stats["write_queue"]
    errors = wq["failed"] + wq["dropped"] + stats["tier_errors"]
    errors += sum(n for (_, _, status), n in (requests or {}).items() if status.startswith("5"))
    t = stats["totals"]
    return {
        "hits": t["hits"],
        "misses": t["misses"],
        "bytes_in": t["bytes_in"],
        "bytes_out": t["bytes_out"],
        "errors": errors,
    }


def gauges(stats: dict) -> dict[str, Any]:
    """What a sample shows as is: the largest pools' fill, pages per tier, the write queue."""
    return {
        "fill": dict(stats["fill"]),
        "pages": dict(stats["pages"]),
        "write_queue": stats["write_queue"]["pending"],
    }


class Sampler:
    """The ring, and the background task that fills it (`run`, started by the Context)."""

    def __init__(self, size: int = RING):
        self.ring: deque[dict] = deque(maxlen=size)
        self._last: tuple[float, dict] | None = None

    def add(self, stats: dict, requests: dict | None = None, now: float | None = None) -> dict:
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
            sample.update(
                hit_rate=d["hits"] / looked if looked else None,
                gbps_in=d["bytes_in"] / dt / 1e9,
                gbps_out=d["bytes_out"] / dt / 1e9,
                errors=d["errors"],
            )
        self._last = (now, cur)
        self.ring.append(sample)
        return sample

    def since(self, t: float = 0.0) -> list[dict]:
        return [s for s in self.ring if s["t"] > t]

    async def run(
        self, stats: Callable[[], dict], requests: Callable[[], dict], interval: float = INTERVAL
    ) -> None:
        while True:
            try:
                self.add(stats(), requests())
            except Exception:  # a sample is never worth the sidecar: log, go on
                log.exception("status sample failed")
            await asyncio.sleep(interval)
