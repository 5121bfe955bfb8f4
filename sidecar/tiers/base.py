"""The tier protocol: what the store, the promoter and the writer ask of every durable tier.

    Tiering (event loop)                       TierWriter (writer threads)
      lookup(identity, keys) -> [bool]  <-+      write_batch([(identity, key, page)]) -> [bool]
      read_batch(identity, [(key, dst)])  |    copy executor / context
      delete / drop / count / describe    +--  recover() at start (and every rescan if shared)

A tier is one class: the local file tier and 3FS (file_tier.py), Mooncake Store
(mooncake_tier.py); an object store or NIXL would be one more file. Pages are addressed by
the namespace identity the store hands over (equal specs, equal identity, on every node)
and the page key. Every failure is a miss or a `False` with a counter, never an exception.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional

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


class Tier:
    """The base every tier derives from; subclasses fill in the I/O."""

    name: str = "tier"
    shared = False          # other nodes publish into it: `recover` runs again every rescan
    remote_lookup = False   # `lookup` does network I/O: Tiering calls it off the event loop
    where = ""              # a directory or an address, for logs
    # told (from any thread, in order) when pages join or leave the index: KV events
    listener: Optional[Callable[[str, list, bool], None]] = None

    def changed(self, identity: str, keys: list, present: bool) -> None:
        """Tell the listener that `keys` of `identity` joined (or left) the index."""
        if self.listener is not None and keys:
            self.listener(identity, keys, present)

    def held_keys(self, identity: str) -> list:
        """The keys of `identity` the index holds now (what events announce for a new
        namespace of that identity)."""
        return []

    # -- index ------------------------------------------------------------------------
    def contains(self, identity: str, key: str) -> bool:
        """What this process knows without I/O (a remote tier: the pages it wrote or read)."""
        raise NotImplementedError

    def lookup(self, identity: str, keys: list[str]) -> list[bool]:
        """Presence of many keys in one call (one round trip for a remote tier)."""
        return [self.contains(identity, k) for k in keys]

    def index(self, identity: str) -> Optional[Mapping[str, Any]]:
        """The keys of `identity` as a mapping whose `in` answers `contains` (a prefix
        is then walked in C: `pools.page_pool.run_in_any`), or None when `contains` does
        more than look up (a shared tier checks the disk on a miss)."""
        return None

    def count(self, identity: str) -> int:
        raise NotImplementedError

    def pages(self) -> int:
        """Pages held, every identity together (the sampler reads it once a second)."""
        return self.describe()["pages"]

    # -- moves ------------------------------------------------------------------------
    def attach(self, address: int, size: int) -> None:
        """The host arena: a tier that moves pages by address registers it here, once."""

    def read(self, identity: str, key: str, dst: memoryview) -> bool:
        raise NotImplementedError

    def read_batch(self, identity: str, items: list[tuple[str, memoryview]]) -> list[bool]:
        """Fill each destination slot with its verified page; False is a miss."""
        return [self.read(identity, key, dst) for key, dst in items]

    def write_batch(self, jobs: list[tuple[str, str, memoryview]]) -> list[bool]:
        """Write (identity, key, page) jobs; True where the page is now in the tier."""
        raise NotImplementedError

    def delete(self, identity: str, keys: list[str]) -> int:
        raise NotImplementedError

    def drop(self, identity: str) -> None:
        """Remove every page of one identity (a deleted namespace)."""
        raise NotImplementedError

    # -- life -------------------------------------------------------------------------
    def recover(self) -> int:
        """Rebuild what the tier knows at start (a thread, never the event loop); pages found."""
        return 0

    def close(self) -> None:
        """Release connections and registrations at shutdown."""

    def describe(self) -> dict:
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        """Monotonic event counts for /metrics (`kv_sidecar_tier_events`)."""
        return asdict(self.stats)


class RateLog:
    """One log line per `interval` seconds for a recurring failure, not one per page."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._last: Optional[float] = None

    def __call__(self, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.interval:
            self._last = now
            log.log(level, msg, *args)
