"""Warm jobs: each brings pages from any tier (file, 3FS, Mooncake) into the host pool,
WARM_CHUNK at a time (`Tiering.promote`), its progress in `/v1/warm/{job}` and `/v1/stats`.

At most WARM_RUNNING_PER_OWNER jobs of an owner run at once (429 past it). Ended jobs are
remembered, WARM_KEPT in all and WARM_KEPT_PER_OWNER of them an owner's (the oldest go
first: no owner's jobs push out another's), without their keys.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sidecar.errors import JobNotFound, TooMany
from sidecar.namespace import Namespace
from sidecar.tenancy import Caller, Directory
from sidecar.tiering import Tiering

WARM_CHUNK = 64
WARM_RUNNING_PER_OWNER = 4
WARM_KEPT = 256  # finished jobs remembered (the oldest go first)
WARM_KEPT_PER_OWNER = 16  # of them an owner's (its oldest go first: none pushes out another's)


@dataclass(slots=True, eq=False)
class WarmJob:
    id: str
    ns: Namespace
    keys: list[str]  # emptied when the job ends (`pages` stays)
    pages: int = 0
    state: str = "running"
    done: int = 0
    loaded: int = 0
    error: str | None = None
    task: Any = field(default=None, repr=False)

    def describe(self, label: str) -> dict[str, Any]:
        out = {
            "job": self.id,
            "namespace": label,
            "state": self.state,
            "pages": self.pages,
            "done": self.done,
            "loaded": self.loaded,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


class Warming(Protocol):
    """What warm jobs act through: the store (`sidecar.store.Store`)."""

    tiering: Tiering
    dir: Directory
    namespaces: dict[str, Namespace]


class Warmer:
    """Every warm job of one store (on the event loop only): the controls start them
    (`sidecar.controls.core.Controls.warm`) once the caller and the pages are checked."""

    def __init__(self, store: Warming):
        self.store = store
        self.jobs: dict[str, WarmJob] = {}

    def check_room(self, owner: Hashable) -> None:
        """429 when WARM_RUNNING_PER_OWNER jobs of `owner` are running."""
        running = sum(1 for j in self.jobs.values() if j.state == "running" and j.ns.owner == owner)
        if running >= WARM_RUNNING_PER_OWNER:
            raise TooMany(
                f"{running} warm jobs of this owner are running; at most "
                f"{WARM_RUNNING_PER_OWNER}: wait for one to end"
            )

    def start(self, ns: Namespace, keys: list[str]) -> WarmJob:
        """A job bringing `keys` of `ns` into the host pool, running from now."""
        job = WarmJob("w-" + secrets.token_hex(8), ns, keys, len(keys))
        self._trim_jobs(ns.owner)
        self.jobs[job.id] = job
        job.task = asyncio.get_running_loop().create_task(self._warm(job))
        return job

    async def _warm(self, job: WarmJob) -> None:
        ns, tiering = job.ns, self.store.tiering
        try:
            for i in range(0, len(job.keys), WARM_CHUNK):
                if ns.pool.closed:
                    raise RuntimeError("the namespace was deleted")
                part = job.keys[i : i + WARM_CHUNK]
                if tiering.enabled:
                    got = await tiering.promote(ns.identity, ns.pool, part)
                    ns.counters.tier_hits += got
                job.done += len(part)
                job.loaded += sum(ns.pool.present(part))
                await asyncio.sleep(0)
            job.state = "done"
        except asyncio.CancelledError:
            job.state, job.error = "failed", "the namespace was deleted"
        except Exception as exc:  # reported through the job, never raised into the loop
            job.state, job.error = "failed", str(exc)[:200]
        finally:
            job.keys = []  # 256 ended jobs of 4,096 keys each would hold ~190 MB

    def _trim_jobs(self, owner: Hashable) -> None:
        """Room for a job of `owner`: its own oldest ended jobs past WARM_KEPT_PER_OWNER go,
        then anyone's oldest ended past WARM_KEPT."""
        ended = [j for j, job in self.jobs.items() if job.state != "running"]
        own = sum(job.ns.owner == owner for job in self.jobs.values())
        mine = [j for j in ended if self.jobs[j].ns.owner == owner]
        for j in mine[: max(own + 1 - WARM_KEPT_PER_OWNER, 0)]:
            del self.jobs[j]
            ended.remove(j)
        for j in ended[: max(len(self.jobs) + 1 - WARM_KEPT, 0)]:
            del self.jobs[j]

    def cancel(self, ns: Namespace) -> None:
        """`ns` is being dropped: its running jobs stop (and say so)."""
        for job in self.jobs.values():
            if job.ns is ns and job.task is not None:
                job.task.cancel()

    def visible(self, who: Caller) -> list[dict[str, Any]]:
        """The jobs of every live namespace `who` reaches, as `/v1/stats` shows them."""
        d = self.store.dir
        return [
            j.describe(d.label(j.ns, who))
            for j in self.jobs.values()
            if self.store.namespaces.get(j.ns.ref) is j.ns and d.reaches(who, j.ns)
        ]

    def job(self, job_id: str, who: Caller) -> dict[str, Any]:
        job = self.jobs.get(job_id) if isinstance(job_id, str) else None
        if (
            job is None
            or self.store.namespaces.get(job.ns.ref) is not job.ns
            or not self.store.dir.reaches(who, job.ns)
        ):
            raise JobNotFound(f"warm job {str(job_id)[:40]!r} is unknown, expired or not yours")
        return job.describe(self.store.dir.label(job.ns, who))
