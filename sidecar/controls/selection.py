"""What a control request names: its pages (`select`) and a pin's TTL (`ttl_of`).

A request names its pages as `{"keys": [...]}` (each of them) or `{"chain": [...], "from":
K}` (the chain's keys from K on; the first when `from` is absent). The sidecar keeps no
parent links between pages (an engine's page keys are opaque hashes, and a set's `parent`
goes into KV events only), so the caller passes the chain in order, as it passes it to
`exists`. Pin and warm take the chain's leading run of present pages from K (a page past a
hole is no use to an engine); evict takes every page from K on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.errors import BadRequest
from sidecar.keys import check_key, check_keys

TTL_DEFAULT = 3600.0  # seconds
TTL_MAX = 7 * 86400.0


@dataclass(slots=True)
class Selection:
    keys: list[str]
    chain: bool


def select(body: Any) -> Selection:
    """The pages a request names: `keys`, or `chain` from `from` on (module docstring)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object with 'keys' or 'chain'")
    if "keys" in body:
        return Selection(list(dict.fromkeys(check_keys(body["keys"]))), False)
    if "chain" not in body:
        raise BadRequest("name the pages as 'keys': [...] or 'chain': [...] (with 'from')")
    chain = check_keys(body["chain"], "chain")
    start = body.get("from")
    if start is None:
        return Selection(list(dict.fromkeys(chain)), True)
    check_key(start)
    if start not in chain:
        raise BadRequest(f"'from' {start[:140]!r} is not a key of 'chain'")
    return Selection(list(dict.fromkeys(chain[chain.index(start) :])), True)


def ttl_of(body: dict) -> float:
    ttl = body.get("ttl", TTL_DEFAULT)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= TTL_MAX:
        raise BadRequest(f"'ttl' must be a number of seconds in (0, {TTL_MAX:.0f}]")
    return float(ttl)
