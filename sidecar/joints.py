"""The joints batch/exists walks: one per set of pools asked together (a KV namespace and
its extra pools).

An engine asks the same pools together again and again. Once a batch/exists naming a
set has passed its checks, the set gets a joint (`pools.joint`: which pools hold each
key, a bit each), and later batches walk its one index instead of one per pool. A joint
over pages already stored is built on the event loop, BUILD_CHUNK keys a step with a
yield between steps (a few ms a step; the step that lists a pool's keys takes longer,
some 10 ms a million keys). Until it is built, batches walk each pool, so answers never
depend on how far a build got. A joint goes with any of its namespaces, and a build
cancelled (the loop closing) drops its joint.

What joints cost stays bounded whatever callers ask: one joint per set of names whatever
the order or which is KV, at most MAX_JOINTS in all, at most PER_POOL over any one pool
(a page write sets or clears its bit in each), at most MAX_POOLS pools each (a mask is
one byte), and one build at a time. Past a bound a batch walks the pools as before; no
joint is evicted, so asking other sets does not make the sidecar build again and again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from pools.joint import MAX_POOLS, Joint

MAX_JOINTS = 16
PER_POOL = 4
BUILD_CHUNK = 4096
_ASKED_MAX = 256


def joint_names(asked: tuple[str, ...]) -> tuple[str, ...]:
    """The names of the joint of the namespaces `asked`, in the order of its pools."""
    return tuple(sorted(set(asked)))


def joint_bits(asked: tuple[str, ...]) -> tuple[int, ...]:
    """The bit (`pools.joint`) of each of the namespaces `asked` in their joint."""
    names = joint_names(asked)
    return tuple(1 << names.index(name) for name in asked)


class Joints:
    """Joints by the sorted names of their namespaces."""

    def __init__(self) -> None:
        self.by_names: dict[tuple[str, ...], Joint] = {}
        self._asked: dict[tuple[str, ...], tuple[str, ...]] = {}  # as asked -> sorted names
        self._building: set[asyncio.Task] = set()

    def get(self, kv: str, others: Sequence[str]) -> Joint | None:
        """The joint of namespace `kv` and `others`, None when there is none (yet)."""
        return self.by_names.get(self._names(kv, others))

    def make(self, kv: str, others: Sequence[str], namespaces: Mapping[str, Any]) -> None:
        """Make the joint of `kv` and `others` among `namespaces` (by name, each with its
        `.pool`) unless it exists, a namespace does not, or a bound is reached."""
        names = self._names(kv, others)
        if (
            names in self.by_names
            or not 2 <= len(names) <= MAX_POOLS
            or self._building
            or len(self.by_names) >= MAX_JOINTS
            or not all(n in namespaces for n in names)
        ):
            return
        pools = [namespaces[n].pool for n in names]
        if any(len(p.joints) >= PER_POOL for p in pools):
            return
        joint = self.by_names[names] = Joint(pools)
        self._build(names, joint)

    def _names(self, kv: str, others: Sequence[str]) -> tuple[str, ...]:
        asked = (kv, *others)
        names = self._asked.get(asked)
        if names is None:
            if len(self._asked) >= _ASKED_MAX:
                self._asked.clear()
            names = self._asked[asked] = joint_names(asked)
        return names

    def _build(self, names: tuple[str, ...], joint: Joint) -> None:
        """Run the first step now (the whole build for pools of up to BUILD_CHUNK keys),
        the rest as a task that yields to the event loop between steps."""
        steps = joint.build(BUILD_CHUNK)
        if next(steps, None) is None:
            return
        task = asyncio.get_running_loop().create_task(self._finish(steps))
        self._building.add(task)
        task.add_done_callback(lambda t: self._built(names, t))

    async def _finish(self, steps) -> None:
        try:
            for _ in steps:
                await asyncio.sleep(0)
        finally:  # the next build may start in this loop turn
            self._building.discard(asyncio.current_task())

    def _built(self, names: tuple[str, ...], task: asyncio.Task) -> None:
        self._building.discard(task)  # a task cancelled before it ran
        if task.cancelled():  # never left half built: it would only add a walk
            self._drop(names)

    def drop(self, name: str) -> None:
        """Drop every joint over namespace `name` (being deleted)."""
        for names in [n for n in self.by_names if name in n]:
            self._drop(names)

    def _drop(self, names: tuple[str, ...]) -> None:
        joint = self.by_names.pop(names, None)
        if joint is not None:
            joint.detach()
