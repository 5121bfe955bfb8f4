"""The joints batch/exists asks: one per KV namespace and set of all-pages pools.

An engine asks the same pools together again and again, so the first batch/exists that
names them makes their joint (`pools.joint`), and later ones walk its one index instead
of one per pool. A joint over pages already stored is built on the event loop, BUILD_CHUNK
keys a step with a yield between steps, so a large pool never stalls it; until then it
answers short and the caller walks the pools as before. A joint goes with any of its
namespaces. What joints cost stays bounded whatever callers ask: at most MAX_JOINTS of at
most MAX_POOLS pools each (a page write tells each of its pool's joints), and one build at
a time; past either, a batch/exists walks the pools as before (no joint is evicted, so
asking other sets does not make the sidecar build again and again).
"""
from __future__ import annotations

import asyncio
from typing import Any, Mapping, Optional

from pools.joint import Joint

MAX_JOINTS = 16
MAX_POOLS = 8
BUILD_CHUNK = 4096


class Joints:
    """Joints by their namespace names: (kv, sorted other names)."""

    def __init__(self) -> None:
        self.by_names: dict[tuple[str, ...], Joint] = {}
        self._building: set[asyncio.Task] = set()

    def get(self, kv: str, others: list[str], namespaces: Mapping[str, Any]) -> Optional[Joint]:
        """The joint of `kv` and `others` (made on first use) among `namespaces` (by name,
        each with its `.pool`); None for no other pool, one that does not exist, or past
        the bounds."""
        joint = self.by_names.get((kv, *others))  # asked in their order: found at once
        if joint is not None:
            return joint
        names = (kv, *sorted(set(others) - {kv}))
        joint = self.by_names.get(names)
        if joint is not None:
            return joint
        if (not 2 <= len(names) <= MAX_POOLS or len(self.by_names) >= MAX_JOINTS
                or self._building or not all(n in namespaces for n in names)):
            return None
        joint = self.by_names[names] = Joint([namespaces[n].pool for n in names])
        self._build(joint)
        return joint

    def _build(self, joint: Joint) -> None:
        """Run the first step now (the whole build for pools of up to BUILD_CHUNK keys),
        the rest as a task that yields to the event loop between steps."""
        steps = joint.build(BUILD_CHUNK)
        if next(steps, None) is None:
            return
        self._building.add(asyncio.get_running_loop().create_task(self._finish(steps)))

    async def _finish(self, steps) -> None:
        try:
            for _ in steps:
                await asyncio.sleep(0)
        finally:
            self._building.discard(asyncio.current_task())

    def drop(self, name: str) -> None:
        """Drop every joint over namespace `name` (being deleted)."""
        for names in [n for n in self.by_names if name in n]:
            self.by_names.pop(names).detach()
