"""The tier protocol: what the store, the promoter and the writer ask of every durable tier.

    Tiering (event loop)                       TierWriter (writer threads)
      lookup(identity, keys) -> [bool]  <-+      write_batch([(identity, key, page)]) -> [bool]
      read_batch(identity, [(key, dst)])  |    copy executor / context
      delete / drop / count / describe    +--  recover() at start (and every rescan if shared)

A tier is one class: the local file tier and 3FS (file_tier.py), Mooncake Store
(mooncake_tier.py); an object store or NIXL would be one more file. Pages are addressed by
the namespace identity the store hands over (equal specs, equal identity, on every node)
and the page key. Every failure is a miss or a `False` with a counter, never an exception.

The contract of each method (which thread calls it, who owns the buffer, what it may raise)
is in its docstring. Threads: "event loop" methods must not block; "executor" and "writer
thread" methods may do I/O. No method raises after start: a broken tier is a miss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("kv_sidecar.tiers")


@dataclass(slots=True)
class TierStats:
    pages_written: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    read_errors: int = 0
    corrupt: int = 0
    evictions: int = 0
    delete_errors: int = 0

    def failed(self, what: str) -> None:
        """Count one failed `read`, `delete` or write (anything else)."""
        if what == "read":
            self.read_errors += 1
        elif what == "delete":
            self.delete_errors += 1
        else:
            self.write_errors += 1


class Tier:
    """The base every tier derives from; subclasses fill in the I/O."""

    name: str = "tier"
    stats: TierStats  # each tier makes its own
    shared = False  # other nodes publish into it: `recover` runs again every rescan
    remote_lookup = False  # `lookup` does network I/O: Tiering calls it off the event loop
    where = ""  # a directory or an address, for logs
    degraded: str | None = None  # why the tier serves misses now (/v1/stats), else None
    # told (from any thread, in order) when pages join or leave the index: KV events
    listener: Callable[[str, list, bool], None] | None = None

    def changed(self, identity: str, keys: list, present: bool) -> None:
        """Tell the listener that `keys` of `identity` joined (or left) the index.

        Called by the tier itself from whatever thread changed the index (a writer thread,
        the executor, `recover`), in the order the changes happened; never raises."""
        if self.listener is not None and keys:
            self.listener(identity, keys, present)

    def held_keys(self, identity: str) -> list:
        """The keys of `identity` the index holds now (what events announce for a new
        namespace of that identity).

        Event loop; no I/O; returns a new list the caller owns. Default: none."""
        return []

    # -- index ------------------------------------------------------------------------
    def contains(self, identity: str, key: str) -> bool:
        """What this process knows without I/O (a remote tier: the pages it wrote or read).

        Event loop, so it must not block (a shared tier may `stat` a miss: a known limit).
        Never raises: an unreadable index answers False. True is a hint, not a promise:
        `read_batch` may still miss (a page deleted or damaged since)."""
        raise NotImplementedError

    def lookup(self, identity: str, keys: list[str]) -> list[bool]:
        """Presence of many keys in one call (one round trip for a remote tier).

        Event loop, unless `remote_lookup` is set: then the executor (Tiering calls it with
        `run_in_executor`). One bool per key, in order. Never raises: a tier that cannot
        answer (connection lost, timeout) answers False for every key and counts it."""
        return [self.contains(identity, k) for k in keys]

    def index(self, identity: str) -> Mapping[str, Any] | None:
        """The keys of `identity` as a mapping whose `in` answers `contains` (a prefix
        is then walked in C: `pools.page_pool.run_in_any`), or None when `contains` does
        more than look up (a shared tier checks the disk on a miss).

        Event loop. The mapping is the tier's own, lent read-only for the current loop turn:
        the caller must not keep it across an `await` or change it. Never raises."""
        return None

    def count(self, identity: str) -> int:
        """Pages of `identity` the index holds. Event loop; no I/O; never raises."""
        raise NotImplementedError

    def pages(self) -> int:
        """Pages held, every identity together (the sampler reads it once a second)."""
        return self.describe()["pages"]

    # -- moves ------------------------------------------------------------------------
    def attach(self, address: int, size: int) -> None:
        """The host arena: a tier that moves pages by address registers it here, once.

        Called once at start, before any move, on the event loop's thread. The arena is
        the sidecar's and outlives the tier (it is unmapped after `close`). May raise
        only at start: the sidecar then refuses to start with the error's message."""

    def read(self, identity: str, key: str, dst: memoryview) -> bool:
        """Fill `dst` with the page's verified bytes; False is a miss (absent, damaged,
        short, unreachable: counted in `stats`, never raised). The executor's thread.
        `dst` is a reserved host-pool slot the caller owns until it commits or aborts:
        the tier writes it only during this call and keeps no reference after it."""
        raise NotImplementedError

    def read_batch(self, identity: str, items: list[tuple[str, memoryview]]) -> list[bool]:
        """Fill each destination slot with its verified page; False is a miss.

        As `read`, for many pages in one call (one round trip for a remote tier): the
        executor's thread, one bool per item in order, never raises, no reference kept to
        any destination after the call."""
        return [self.read(identity, key, dst) for key, dst in items]

    def write_batch(self, jobs: list[tuple[str, str, memoryview]]) -> list[bool]:
        """Write (identity, key, page) jobs; True where the page is now in the tier.

        A writer thread (`tiers/writer.py`), several at once for one tier: the tier locks
        what its threads share. Each page is a pinned host-pool slot, readable only for
        the length of the call (the writer unpins it after). True means durable by the
        tier's rule (a local file: written under a unique temporary name, fsynced, renamed,
        its directory fsynced) and `changed` told. Never raises: a failed page is False
        and counted (`write_errors`)."""
        raise NotImplementedError

    def delete(self, identity: str, keys: list[str]) -> int:
        """Remove `keys` of `identity`; the number removed. The executor's thread, after
        Tiering settled the writes of those keys (none publishes after this). A delete the
        tier cannot perform (read-only disk) leaves the page: `contains` then still answers
        True and the store reports it failed. Never raises (counted in `delete_errors`)."""
        raise NotImplementedError

    def drop(self, identity: str) -> None:
        """Remove every page of one identity (a deleted namespace).

        The executor's thread; may take long (many files). Never raises: what could not
        be removed stays counted by `count`."""
        raise NotImplementedError

    # -- life -------------------------------------------------------------------------
    def recover(self) -> int:
        """Rebuild what the tier knows at start (a thread, never the event loop); pages found.

        Verifies what it indexes (a damaged or partial file is skipped and counted, never
        served); for a `shared` tier it runs again at every rescan. Never raises for a bad
        page; an unusable directory raises at start only."""
        return 0

    def close(self) -> None:
        """Release connections and registrations at shutdown.

        A thread, after the writer stopped; no method is called after it. Never raises."""

    def describe(self) -> dict:
        """A JSON-able summary for /v1/stats: at least `pages` (every identity). Event
        loop; no I/O; never raises."""
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        """Monotonic event counts for /metrics (`kv_sidecar_tier_events`)."""
        return asdict(self.stats)


class RateLog:
    """One log line per `interval` seconds for a recurring failure, not one per page."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._last: float | None = None

    def __call__(self, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.interval:
            self._last = now
            log.log(level, msg, *args)
