"""Load a stored prefix only when restoring it beats recomputing it (issue 44).

    restore(pages by tier) = round trip + sum(bytes on tier t / read rate of t)
    prefill(tokens)        = tokens / the engine's prefill rate
    load the longest candidate prefix whose restore < prefill; else the engine recomputes

Every rate is an EWMA of what this engine and the tiers actually did: prefill tokens/s
from the engine's own forward timings, restore bytes/s by the tier the pages came from
(`HOST`: the sidecar's host pool, `LOCAL`: a file tier, 3FS included, `REMOTE`: Mooncake),
and the round trip of the lookups. Cold start is optimistic: with no measurement of the
prefill or of a tier, the prefix loads and the load is measured. A tier judged too slow
is tried again (one load) after `probe_s`, then after twice as long each time it is still
slow (at most an hour), so a tier that recovers is seen to and one that does not costs
one slow request an hour at most. Nothing here raises: the callers answer "recompute" (the adapters' rule) on any error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

HOST, LOCAL, REMOTE = "host", "local", "remote"
TIERS = (HOST, LOCAL, REMOTE)


@dataclass
class Ewma:
    """An exponentially weighted mean; None until the first observation."""

    alpha: float = 0.3
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


@dataclass
class RestoreCost:
    """The estimates of one engine (one scheduler), thread-safe."""

    alpha: float = 0.3
    probe_s: float = 60.0  # a tier judged too slow is tried again after this
    min_seconds: float = 1e-4  # shorter timings are noise: ignored
    clock: Callable[[], float] = time.monotonic
    prefill: Ewma = field(init=False)  # tokens/s
    rtt: Ewma = field(init=False)  # seconds
    rates: dict[str, Ewma] = field(init=False)  # bytes/s by tier
    judged: dict[str, float] = field(default_factory=dict)  # tier -> when last judged too slow
    waits: dict[str, float] = field(default_factory=dict)  # tier -> seconds until its next probe
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.prefill, self.rtt = Ewma(self.alpha), Ewma(self.alpha)
        self.rates = {t: Ewma(self.alpha) for t in TIERS}

    # -- observations ------------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward that computed `tokens` prompt tokens in `seconds`."""
        if tokens > 0 and seconds >= self.min_seconds:
            with self.lock:
                self.prefill.add(tokens / seconds)

    def observe_rtt(self, seconds: float) -> None:
        if seconds >= 0:
            with self.lock:
                self.rtt.add(seconds)

    def observe_restore(self, nbytes: dict[str, int], seconds: float) -> None:
        """A load of `nbytes` (by tier) that took `seconds`, its round trip included. The
        time beyond the round trip and the faster tiers' predicted share is the slowest
        tier's (a load from one tier measures that tier exactly)."""
        moved = {t: b for t, b in nbytes.items() if t in self.rates and b > 0}
        if not moved:
            return
        with self.lock:
            slowest = max(moved, key=TIERS.index)
            rest = seconds - (self.rtt.value or 0.0)
            for t, b in moved.items():
                rate = self.rates[t].value
                if t != slowest and rate:
                    rest -= b / rate
            self.rates[slowest].add(moved[slowest] / max(rest, self.min_seconds))

    # -- decisions ---------------------------------------------------------------------
    def restore_seconds(self, nbytes: dict[str, int]) -> float | None:
        """Predicted restore time; None when a tier it reads has no measurement yet."""
        total = self.rtt.value or 0.0
        for t, b in nbytes.items():
            if b <= 0:
                continue
            rate = self.rates[t].value if t in self.rates else None
            if not rate:
                return None
            total += b / rate
        return total

    def worth(self, tokens: int, nbytes: dict[str, int]) -> bool:
        """Whether restoring these pages (`tokens` the engine would otherwise compute)
        should beat computing them: optimistic while anything is unmeasured."""
        with self.lock:
            rate = self.prefill.value
            restore = self.restore_seconds(nbytes)
            if rate is None or restore is None:
                return True
            slow = max((t for t, b in nbytes.items() if b > 0 and t in self.rates), key=TIERS.index)
            if restore < tokens / rate:
                self.judged.pop(slow, None)
                self.waits.pop(slow, None)
                return True
            now = self.clock()
            since = self.judged.setdefault(slow, now)
            wait = self.waits.get(slow, self.probe_s)
            if now - since >= wait:  # try it once more: the tier may have recovered
                self.judged[slow] = now
                self.waits[slow] = min(2 * wait, 3600.0)
                return True
            return False

    def choose(self, candidates: list[tuple[int, dict[str, int]]]) -> int:
        """Of (tokens to load, bytes by tier) candidates, longest first, the tokens of the
        first worth loading; 0: recompute them all."""
        for tokens, nbytes in candidates:
            if tokens > 0 and self.worth(tokens, nbytes):
                return tokens
        return 0

    def snapshot(self) -> dict:
        """The estimates (logs, tests)."""
        with self.lock:
            return {
                "prefill_tokens_per_s": self.prefill.value,
                "rtt_s": self.rtt.value,
                "bytes_per_s": {t: e.value for t, e in self.rates.items()},
            }


def by_tier(pages: int, host: int, local: int, page_bytes: int, start: int = 0) -> dict[str, int]:
    """Bytes by tier of pages [start, pages) of a prefix whose first `host` pages are in
    the host pool and first `local` in the host pool or a local tier (the rest remote)."""
    h = max(0, min(host, pages) - start)
    lo = max(0, min(local, pages) - max(host, start))
    r = max(0, pages - max(local, start))
    return {HOST: h * page_bytes, LOCAL: lo * page_bytes, REMOTE: r * page_bytes}
