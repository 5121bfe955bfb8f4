"""Several pools at once (hybrid models): SGLang's `batch_exists_v2` hit rule and batch moves.

    keys:        k0  k1  k2  k3  k4  k5
    kv:           x   x   x   x   x   .     kv hit = 5 (longest present prefix)
    mamba (w=1):  .   .   x   .   x   .     trailing_pages: largest p <= 5 with [p-1, p) present = 5
    swa   (w=2):  x   x   x   .   x   .     trailing_pages: largest p with [p-2, p) present = 3
    indexer:      x   x   .   x   x   .     all_pages: first missing index in [0, 5) = 2
    hit = min(5, 5, 3, 2) = 2; the loop stops once the hit is 0.

Extra pools keep a page under the KV key of the same position.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Optional

from sidecar.errors import BadRequest
from sidecar.peer import Peer
from sidecar.spec import check_name
from sidecar.store import Store

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
POLICIES = (ALL_PAGES, TRAILING_PAGES)


@dataclass(frozen=True, slots=True)
class ExtraPool:
    namespace: str
    policy: str = ALL_PAGES
    window: int = 1


def boundary(present: list[bool], kv_hit: int, policy: str, window: int = 1) -> int:
    """How many leading pages of the KV hit this pool can serve (`present` covers >= kv_hit)."""
    if policy == ALL_PAGES:
        for i in range(kv_hit):
            if not present[i]:
                return i
        return kv_hit
    run = 0
    runs = []
    for i in range(kv_hit):  # runs[i] = present pages ending at i
        run = run + 1 if present[i] else 0
        runs.append(run)
    for p in range(kv_hit, 0, -1):
        if runs[p - 1] >= min(window, p):
            return p
    return 0


def parse_extra(raw: Any) -> list[ExtraPool]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > 64:
        raise BadRequest("'extra' must be a list of at most 64 {namespace, policy, window}")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("namespace"), str):
            raise BadRequest(f"extra[{i}] must be an object with a 'namespace' string")
        unknown = set(item) - {"namespace", "policy", "window"}
        if unknown:
            raise BadRequest(f"extra[{i}] has unknown fields {sorted(unknown)}")
        policy = item.get("policy", ALL_PAGES)
        if policy not in POLICIES:
            raise BadRequest(f"extra[{i}].policy must be one of {list(POLICIES)}")
        window = item.get("window", 1)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise BadRequest(f"extra[{i}].window must be an integer >= 1")
        out.append(ExtraPool(check_name(item["namespace"]), policy, window))
    return out


async def batch_exists(store: Store, keys: Any, kv: Any, extra: list[ExtraPool]) -> dict[str, Any]:
    """{"hit", "kv", "pools"}: the KV prefix, then min over extra pools (0 once it is 0)."""
    if not isinstance(kv, str):
        raise BadRequest("'kv' must name the KV namespace")
    kv_hit = await store.prefix(kv, keys)  # validates the keys past the prefix
    hit, pools = kv_hit, {}
    for pool in extra:
        if hit == 0:
            pools[pool.namespace] = 0
            continue
        ns = store.namespaces.get(pool.namespace)
        b = 0 if ns is None else boundary(ns.pool.present(keys[:kv_hit]), kv_hit,
                                          pool.policy, pool.window)
        pools[pool.namespace] = b
        hit = min(hit, b)
    return {"hit": hit, "kv": kv_hit, "pools": pools}


@dataclass(frozen=True, slots=True)
class Item:
    namespace: str
    keys: list
    buffer_id: Any
    slots: Any


def parse_items(store: Store, raw: Any, peer: Optional[Peer] = None) -> list[Item]:
    """Validate every item (namespace, keys, buffer, slots) before any page moves."""
    if not isinstance(raw, list) or not raw or len(raw) > 64:
        raise BadRequest("'items' must be a non-empty list of at most 64 items")
    items, seen = [], set()
    for i, it in enumerate(raw):
        if not isinstance(it, dict):
            raise BadRequest(f"items[{i}] must be an object")
        name = it.get("namespace")
        if not isinstance(name, str) or name in seen:
            raise BadRequest(f"items[{i}].namespace must be a namespace named once per request")
        seen.add(name)
        item = Item(name, it.get("keys"), it.get("buffer_id"), it.get("slots"))
        store.check_move(item.namespace, item.keys, item.buffer_id, item.slots, peer)
        items.append(item)
    return items


async def batch_set(store: Store, raw_items: Any, peer: Optional[Peer] = None) -> dict[str, list[bool]]:
    """Each pool stores what it can: one pool out of room does not fail the others."""
    items = parse_items(store, raw_items, peer)
    results = await asyncio.gather(*(store.set(i.namespace, i.keys, i.buffer_id, i.slots, peer=peer)
                                     for i in items))
    return {i.namespace: r for i, r in zip(items, results)}


async def batch_get(store: Store, raw_items: Any, kv: Optional[str] = None,
                    peer: Optional[Peer] = None) -> dict[str, list[bool]]:
    """KV items first; the other items only when every KV page loaded, else all false."""
    items = parse_items(store, raw_items, peer)
    if kv is not None and kv not in {i.namespace for i in items}:
        raise BadRequest(f"'kv' names {kv!r}, which is not one of the items")
    anchors = [i for i in items if (i.namespace == kv if kv is not None
                                    else store.namespace(i.namespace).spec.pool == "kv")]
    loaded: dict[str, list[bool]] = {}
    for i in anchors:
        loaded[i.namespace] = await store.get(i.namespace, i.keys, i.buffer_id, i.slots, peer)
    complete = all(all(v) for v in loaded.values())
    rest = [i for i in items if i not in anchors]
    if complete:
        results = await asyncio.gather(*(store.get(i.namespace, i.keys, i.buffer_id, i.slots, peer)
                                         for i in rest))
    else:
        results = [[False] * len(i.keys) for i in rest]
    loaded.update({i.namespace: r for i, r in zip(rest, results)})
    return {i.namespace: loaded[i.namespace] for i in items}
