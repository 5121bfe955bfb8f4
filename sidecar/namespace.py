"""A namespace: one pool of fixed-size pages, its spec, its owner and its engine buffers.

Kept apart from the store so that the modules that reason about namespaces (tenancy,
controls, cost) import it without importing the store that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NewType

from pools import PagePool
from sidecar.buffers import Buffer
from sidecar.errors import BufferNotFound
from sidecar.peer import Peer
from sidecar.spec import NamespaceSpec

Owner = int | str | None  # a uid, tenancy.TCP_TENANT, or None (the operator)
# a namespace's key in the store, apart from the name a caller sends: made only by
# sidecar/tenancy.py (`ref_of`, `Directory.ref`); declared here, as Owner is, for
# tenancy imports this module
Ref = NewType("Ref", str)


@dataclass(slots=True)
class Counters:
    """Per-namespace totals since start (exported by /v1/stats and /metrics)."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    no_room: int = 0
    tier_hits: int = 0
    restores_skipped: int = 0  # loads an engine recomputed instead (slower than prefill)
    restore_pages_skipped: int = 0


@dataclass(slots=True, eq=False)
class Namespace:
    name: str
    spec: NamespaceSpec
    pool: PagePool
    identity: str
    owner: Owner = None  # its maker's uid; None: the operator; TCP_TENANT
    ref: Ref = Ref("")  # its key in the store (`tenancy.ref_of`)
    buffers: dict[str, Buffer] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    joined: set[int] = field(default_factory=set)  # uids of members that PUT it (shared)

    def buffer(self, buffer_id: Any, peer: Peer | None = None) -> Buffer:
        """The buffer `buffer_id`, if `peer` may use it (another user's reads as unknown)."""
        buf = self.buffers.get(buffer_id) if isinstance(buffer_id, str) else None
        if buf is None or not buf.usable_by(peer):
            raise BufferNotFound(
                f"buffer {str(buffer_id)[:40]!r} is not registered in "
                f"namespace {self.name!r}; register it with POST .../buffers"
            )
        return buf
