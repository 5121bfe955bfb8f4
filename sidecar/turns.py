"""Loop turns (issue 52's rule: no loop turn grows with the data): the sidecar's own watch
on its event loop, and the helper that frees what a path drops a bounded part a turn.

Paths whose work grows with pages, pins, keys or subscribers run in bounded chunks a turn:
the controls end pins CHUNK (512) a turn (sidecar/controls/core.py), a dropped pool's entries
are freed REAP a turn (`reap_later`), listings show 4,096 at most, the write-back flush
checks 4,096 pages a turn (sidecar/tiering.py). tests/api/test_loop_turns.py holds them to
50 ms at a million items, measured by this monitor.

A timer asks to run every INTERVAL seconds; how late each firing comes is how long the
turn before it held the loop (give or take one interval). The longest since start (or since
`reset`) and the longest of the last WINDOW seconds are in /v1/stats `loop`.

    due      fired                    late = fired - due  ~  the turn that held the loop
    |--------|                        longest = max(late)
    t        t + late
"""

from __future__ import annotations

import asyncio
import gc
import time

from pools.page_pool import PagePool

INTERVAL = 0.005  # seconds between the timer's firings
UNFREEZE = 3600.0  # seconds between full walks of the frozen heap (cycles among it freed)
WINDOW = 10.0  # seconds the recent maximum covers


class LoopMonitor:
    """Lateness of a periodic timer on the running loop: the longest loop turn seen."""

    __slots__ = (
        "_thawed",
        "longest",
        "recent",
        "gc_longest",
        "_gc_from",
        "_recent_from",
        "_due",
        "_handle",
        "_loop",
    )

    def __init__(self) -> None:
        self.longest = self.recent = 0.0  # seconds
        self.gc_longest = 0.0  # the longest full (generation 2) collection of the process
        self._gc_from = 0.0
        self._thawed = time.perf_counter()  # when the frozen heap was last walked
        self._recent_from = self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due = self._recent_from = loop.time() + INTERVAL
        self._handle = loop.call_at(self._due, self._fire)
        gc.callbacks.append(self._gc)

    def stop(self) -> None:
        """(The frozen heap stays frozen: the process is ending, or a test's is shared.)"""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        """A full collection walks every tracked object, so its pause grows with the index
        (a million pages and pins: 0.4 s). What survives one is long-lived (the index,
        pins, namespaces): it is frozen (`gc.freeze`), and the next full collections walk
        only what came since. Index entries leave acyclically (their LRU links are
        broken), so what freezing keeps from the collector is only frozen objects that
        later die in a cycle (requests in flight at a freeze): every UNFREEZE seconds the
        heap is unfrozen and walked once, freeing them."""
        if info.get("generation") != 2:
            return
        now = time.perf_counter()
        if phase == "start":
            self._gc_from = now
            return
        if self._gc_from:
            self.gc_longest = max(self.gc_longest, now - self._gc_from)
        if now - self._thawed > UNFREEZE:
            self._thawed = now
            gc.unfreeze()  # the next full collection walks (and frees) everything once
        else:
            gc.freeze()

    def reset(self) -> float:
        """The longest turn since start or the last reset (seconds), and start again."""
        longest, self.longest = self.longest, 0.0
        return longest

    def _fire(self) -> None:
        assert self._loop is not None, "fired before start"
        now = self._loop.time()
        late = max(0.0, now - self._due)
        self.longest = max(self.longest, late)
        if now - self._recent_from > WINDOW:
            self.recent, self._recent_from = late, now
        else:
            self.recent = max(self.recent, late)
        self._due = now + INTERVAL
        self._handle = self._loop.call_at(self._due, self._fire)

    def describe(self) -> dict[str, float]:
        return {
            "longest_turn_ms": round(self.longest * 1e3, 3),
            "recent_longest_turn_ms": round(self.recent * 1e3, 3),
            "gc_longest_full_ms": round(self.gc_longest * 1e3, 3),
        }


REAP = 4096  # a dropped pool's entries freed a loop turn
_reaping: set[asyncio.Task] = set()


def reap_later(pool: PagePool) -> None:
    """Free a dropped pool's entries REAP a loop turn (`PagePool.reap`); at once when no
    loop runs (no turn to hold)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        while not pool.reap(1 << 30):
            pass
        return
    if pool.reap(REAP):
        return

    async def reap() -> None:
        while not pool.reap(REAP):
            await asyncio.sleep(0)

    task = loop.create_task(reap())
    _reaping.add(task)
    task.add_done_callback(_reaping.discard)
