"""Operators' controls over what is cached: pin, unpin, evict and warm, by keys or by chain.

    who                      may control
    the operator (token)     every namespace
    any other caller         the namespaces it owns (`owner_of(caller) == ns.owner`);
                             a namespace shared with it (share_gid) is not its own: 403

    selection.py   what a request names: its pages (keys, or a chain from a key) and a TTL
    warm.py        warm jobs: pages promoted from the tiers into the host pool
    pin_store.py   the pin store on disk: each namespace's pins as a record in the data dir
    keeper.py      the restore of kept pins: written as they change, back after a restart
                   (through the controls' public `hold` and `arm`)
    core.py        `Controls`: the pins (bound, TTL, expiry), evict, warm, the store's hooks

A module imports only modules listed above it; this one names what the rest of the sidecar
uses (`from sidecar.controls import Controls`).
"""

from sidecar.controls.core import CHUNK, LIST_MAX, RECHECK, Controls, Holder, Pin
from sidecar.controls.keeper import Keeper, Pinner
from sidecar.controls.pin_store import PinStore
from sidecar.controls.selection import TTL_DEFAULT, TTL_MAX, Selection, select, ttl_of
from sidecar.controls.warm import (
    WARM_CHUNK,
    WARM_KEPT,
    WARM_KEPT_PER_OWNER,
    WARM_RUNNING_PER_OWNER,
    Warmer,
    WarmJob,
)

__all__ = [
    "CHUNK",
    "LIST_MAX",
    "RECHECK",
    "TTL_DEFAULT",
    "TTL_MAX",
    "WARM_CHUNK",
    "WARM_KEPT",
    "WARM_KEPT_PER_OWNER",
    "WARM_RUNNING_PER_OWNER",
    "Controls",
    "Holder",
    "Keeper",
    "Pin",
    "PinStore",
    "Pinner",
    "Selection",
    "Warmer",
    "WarmJob",
    "select",
    "ttl_of",
]
