"""What the store tells about itself: `/v1/stats` and `/metrics` (`stats`, every namespace
the asker reaches) and the 1 s sampler's reading (`sample`, bounded whatever the number
of namespaces)."""

from __future__ import annotations

import heapq
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from sidecar import cost
from sidecar.tenancy import OPERATOR, Caller

if TYPE_CHECKING:
    from sidecar.store import Store

FILL_TOP = 16  # namespaces whose fill the sampler follows (the largest)


def stats(store: Store, who: Caller = OPERATOR) -> dict[str, Any]:
    """Counters of the process and of every namespace `who` reaches (by the name it knows
    each one by)."""
    hp, tiering = store.host_pool, store.tiering
    spaces = {}
    for ns in store.dir.visible(who):
        c, pool = ns.counters, ns.pool
        spaces[store.dir.label(ns, who)] = {
            "pool": ns.spec.pool,
            "page_bytes": ns.spec.page_bytes,
            "pages": {"host": pool.ready_pages, **tiering.counts(ns.identity)},
            "capacity_pages": pool.capacity_pages,
            "tier_hits": c.tier_hits,
            "capacity_bytes": pool.capacity_pages * ns.spec.page_bytes,
            "hits": c.hits,
            "misses": c.misses,
            "evictions": pool.evictions,
            "stored": c.stored,
            "no_room": c.no_room,
            "buffers": len(ns.buffers),
            "bytes_in": c.bytes_in,
            "bytes_out": c.bytes_out,
            "restores_skipped": c.restores_skipped,
            "restore_pages_skipped": c.restore_pages_skipped,
        }
    out = {
        "host_pool": {
            "bytes": hp.arena.size,
            "segment_size": hp.segment_size,
            "segments": hp.n_segments,
            "free_segments": len(hp.free_segments),
        },
        "tiers": {t.name: t.describe() for t in tiering.tiers},
        "write_policy": tiering.policy,
        "write_queue": {
            **_queue(store),
            "cancelled": tiering.writer.cancelled if tiering.writer else 0,
            "promote_waits": tiering.room_waits,
        },
        "namespaces": spaces,
        "controls": store.controls.summary(who),
        "cost": cost.measure(store, who),
    }
    if who is OPERATOR:  # every tenant's copies: the operator's to see
        out["copies"] = asdict(store.copier.times)
    if store.events is not None:
        pub = store.events.publisher
        out["events"] = {
            "published": store.events.published,
            "dropped": store.events.dropped,
            "dropped_bytes": store.events.dropped_bytes,
            "identities": len(store.events.identities),
            "replay_batches": len(pub.ring),
            "replay_bytes": pub.ring.bytes,
            "replays": pub.replays,
            "replays_given_up": pub.replays_given_up,
            **pub.stats(),  # subscribers, refused_subscribers, ... (sidecar/publisher.py)
        }
    return out


def sample(store: Store, fill_top: int = FILL_TOP) -> dict[str, Any]:
    """What the 1 s sampler reads (sidecar/samples.py), without a walk of every namespace's
    counters: the totals, the pages of the host pool and of each tier, the write queue,
    and the fill of the `fill_top` namespaces with the most capacity (by ref: `fill_for`
    names them to each asker)."""
    tiers = store.tiering.tiers
    top = heapq.nlargest(fill_top, store.namespaces.values(), key=lambda ns: ns.pool.capacity_pages)
    return {
        "totals": asdict(store.totals),
        "fill": {
            ns.ref: ns.pool.ready_pages / ns.pool.capacity_pages
            for ns in top
            if ns.pool.capacity_pages
        },
        "pages": {
            "host": sum(p.ready_pages for p in store.host_pool.pools.values()),
            **{t.name: t.pages() for t in tiers},
        },
        "write_queue": _queue(store),
        "tier_errors": sum(
            t.stats.write_errors + t.stats.read_errors + t.stats.corrupt for t in tiers
        ),
    }


def fill_for(store: Store, who: Caller, samples: list[dict]) -> list[dict]:
    """`samples` (of `sample`) with each fill named as `who` knows the namespace now, and
    only the namespaces `who` reaches (the operator: every one; a gone one by its ref)."""
    names = {ns.ref: store.dir.label(ns, who) for ns in store.dir.visible(who)}
    out = []
    for s in samples:
        fill = {names.get(ref, ref if who is OPERATOR else None): v for ref, v in s["fill"].items()}
        fill.pop(None, None)
        out.append({**s, "fill": fill})
    return out


def _queue(store: Store) -> dict[str, int]:
    writer = store.tiering.writer
    return {
        "pending": writer.pending if writer else 0,
        "failed": writer.failed if writer else 0,
        "dropped": writer.dropped if writer else 0,
    }
