"""The restore of kept pins: the controls' pins written to the pin store as they change
(`keep`) and brought back into a namespace made again after a restart (`restore`).

A namespace re-created with the same spec and owner gets its kept pins back: the expired
ones dropped, the rest promoted from the tiers CHUNK a step (as a warm does) and pinned for
what is left of their TTL, oldest first, each under the owner's bound (past it the newest
are dropped). Pins go through the controls' public `hold` and `arm` (the `Pinner` protocol).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Hashable
from typing import Any, Protocol

from sidecar.controls.pin_store import MAX_AGE, PERSIST_MAX, Pins, PinStore
from sidecar.namespace import Namespace, Ref

log = logging.getLogger("kv_sidecar.pins")
CHUNK = 64  # pins a restore promotes and pins a step (warm.WARM_CHUNK)


class Pinner(Protocol):
    """What a keeper restores through: the controls (`sidecar.controls.core.Controls`),
    named by this protocol so that the controls import the keeper and not the reverse."""

    store: Any  # its `namespaces` (by ref) and `tiering`
    pins: dict[Ref, dict[str, Any]]  # ns ref -> key -> pin (its `expires`: loop time)

    def bound_segments(self, owner: Hashable) -> int: ...

    def hold(self, ref: Ref, ns: Namespace, key: str, expires: float, bound: int) -> bool: ...

    def arm(self, loop: asyncio.AbstractEventLoop) -> None: ...


class Keeper:
    """The controls' pins as kept (`keep`: a namespace's pins now, in a coalesced write)
    and brought back into a namespace made again (`restore`), on the event loop."""

    def __init__(self, ctl: Pinner, saved: PinStore):
        self.ctl, self.saved = ctl, saved
        self.restoring: dict[Namespace, asyncio.Task] = {}
        self.restores: Counter = Counter()  # pins a restore brought back or dropped, by why

    def snapshot(self, ns: Namespace) -> Pins:
        """`ns`'s pins as kept: (key, wall-clock expiry), oldest first; none once dropped."""
        if self.ctl.store.namespaces.get(ns.ref) is not ns:
            return []
        now, wall = asyncio.get_running_loop().time(), time.time()
        mine = itertools.islice(self.ctl.pins.get(ns.ref, {}).items(), PERSIST_MAX)
        return [(k, wall + p.expires - now) for k, p in mine]

    def keep(self, ns: Namespace) -> asyncio.Future:
        """Keep `ns`'s pins as they are now: the future answers whether the data dir does."""
        return self.saved.changed(ns.identity, ns.ref, ns.owner, lambda: self.snapshot(ns))

    def restore(self, ns: Namespace) -> None:
        self.restoring[ns] = asyncio.get_running_loop().create_task(self._restore(ns))

    def stop(self, ns: Namespace) -> bool:
        """`ns` is being dropped: its restore stops (its record then goes); whether one ran."""
        task = self.restoring.pop(ns, None)
        if task is not None:
            task.cancel()
        return task is not None

    async def _restore(self, ns: Namespace) -> None:
        kept: Pins = []
        try:
            kept = await self.saved.load(ns.identity, ns.ref, ns.owner)
            await self._bring_back(ns, kept)
        except Exception:  # logged: a restore that failed leaves the namespace unpinned
            log.exception("restoring the pins of %s failed", ns.ref)
        finally:
            if self.restoring.get(ns) is asyncio.current_task():
                del self.restoring[ns]
            gone = self.ctl.store.namespaces.get(ns.ref) is not ns
            self.saved.release(ns.identity, ns.ref, lambda: self.snapshot(ns), bool(kept) or gone)

    async def _bring_back(self, ns: Namespace, kept: Pins) -> None:
        """Pin `kept` in `ns` again: the expired dropped; the rest promoted from the tiers
        CHUNK a step (as a warm does) and pinned for what is left of their TTL, oldest
        first, each under the owner's bound (past it the newest are dropped)."""
        ctl, loop, wall = self.ctl, asyncio.get_running_loop(), time.time()
        live = [(k, min(t - wall, MAX_AGE)) for k, t in kept if t > wall]
        self.restores["expired"] += len(kept) - len(live)
        tiering = ctl.store.tiering
        for i in range(0, len(live), CHUNK):
            part = live[i : i + CHUNK]
            missing = [k for k, _ in part if not ns.pool.contains(k)]
            if missing and tiering.enabled and not ns.pool.closed:
                ns.counters.tier_hits += await tiering.promote(ns.identity, ns.pool, missing)
            if ctl.store.namespaces.get(ns.ref) is not ns:
                return
            now, bound = loop.time(), ctl.bound_segments(ns.owner)
            for k, left in part:
                if k in ctl.pins.get(ns.ref, ()):  # pinned again meanwhile
                    why = "restored"
                elif k not in ns.pool.ready:
                    why = "missing"  # in no tier any more
                elif ctl.hold(ns.ref, ns, k, now + left, bound):
                    why = "restored"
                else:
                    why = "over_bound"
                self.restores[why] += 1
            ctl.arm(loop)

    async def close(self, timeout: float) -> None:
        """Shutdown: writes due end (at most `timeout` s), then none: the namespaces a
        shutdown drops keep their records; restores stop (their records untouched)."""
        await self.saved.close(timeout)
        for task in self.restoring.values():
            task.cancel()
        await asyncio.gather(*self.restoring.values(), return_exceptions=True)

    def describe(self) -> dict[str, int]:
        """Counters for `/v1/pins` and `/v1/stats`: pins restored, or dropped at a restore
        (expired, in no tier, over the bound); records written, failed, found damaged."""
        r, s = self.restores, self.saved
        return {
            "restored": r["restored"],
            "restore_expired": r["expired"],
            "restore_missing": r["missing"],
            "restore_over_bound": r["over_bound"],
            "records_written": s.written,
            "record_write_errors": s.write_errors,
            "records_damaged": s.damaged,
        }
