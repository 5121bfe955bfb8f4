"""What a cached token costs: host-pool bytes, index bytes and RSS per stored page and per
token, against the host pool's nominal size (`--host-pool`, the arena mapped whole).

    host_bytes   the arena's nominal size / pages stored now (falls as the pool fills);
                 `slot_bytes` is the floor at a full pool: a segment / the pages it holds
                 (a segment's tail that holds no page is paid by its pages)
    index_bytes  the Python objects that find a page: its Entry, its key, its slots in
                 the pool's dicts (`entries`, `ready`, slot index) and in the local tiers'
                 key indexes; sizes read with sys.getsizeof, keys sampled (SAMPLE a pool)
    rss_bytes    the process's resident memory (/proc/self/status VmRSS: the arena is
                 mapped populated, so it is in it whole) / pages stored

Per token: per page / the namespace's `page_tokens` (namespaces that give it). Every figure
is read in O(pools) on the loop: no walk of the pages.
"""

from __future__ import annotations

import itertools
import sys
from typing import TYPE_CHECKING, Any

from pools.page_pool import Entry, PagePool

if TYPE_CHECKING:
    from sidecar.namespace import Namespace
    from sidecar.store import Store
    from sidecar.tenancy import Caller

SAMPLE = 32
ENTRY_BYTES = sys.getsizeof(Entry("", 0))


def _avg(objs: Any) -> float:
    sizes = [sys.getsizeof(o) for o in itertools.islice(objs, SAMPLE)]
    return sum(sizes) / len(sizes) if sizes else 0.0


def pool_index_bytes(pool: PagePool) -> int:
    """The pool's index: its dicts, one Entry and one key a page (keys sampled)."""
    n = len(pool.entries)
    dicts = sum(map(sys.getsizeof, (pool.entries, pool.ready, pool._by_offset)))
    return int(dicts + n * (ENTRY_BYTES + _avg(pool.entries)))


def tier_index_bytes(store: Store, ns: Namespace) -> int:
    """The local tiers' key indexes of this namespace's identity (a tier without one: 0)."""
    out = 0
    for tier in store.tiering.tiers:
        index = None if tier.remote_lookup else tier.index(ns.identity)
        if index:
            out += int(sys.getsizeof(index) + len(index) * (_avg(index) + _avg(index.values())))
    return out


def rss_bytes() -> int:
    """VmRSS of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _per(total: float, n: float) -> float | None:
    return round(total / n, 1) if n else None


def _namespace(store: Store, ns: Namespace) -> dict[str, Any]:
    pool, spec = ns.pool, ns.spec
    pages = pool.ready_pages
    index = pool_index_bytes(pool) + tier_index_bytes(store, ns)
    slot = pool.segment_size / pool.slots_per_segment
    tokens = spec.page_tokens or 0
    return {
        "pages": pages,
        "page_bytes": spec.page_bytes,
        "page_tokens": tokens or None,
        "slot_bytes": round(slot, 1),
        "index_bytes": index,
        "index_bytes_per_page": _per(index, pages),
        "bytes_per_token": _per(slot + (index / pages if pages else 0), tokens),
    }


def measure(store: Store, who: Caller) -> dict[str, Any]:
    """The node's figures and each namespace's that `who` reaches (`/v1/cost`, `/v1/stats`,
    `/metrics`)."""
    hp = store.host_pool
    nominal, rss = hp.arena.size, rss_bytes()
    every = list(store.dir.visible(who))  # (a tenant's figures are of its own pages)
    spaces = {store.dir.label(ns, who): _namespace(store, ns) for ns in every}
    pages = sum(ns.pool.ready_pages for ns in every)
    tokens = sum(ns.pool.ready_pages * (ns.spec.page_tokens or 0) for ns in every)
    index = sum(pool_index_bytes(ns.pool) for ns in every)
    node = {
        "nominal_bytes": nominal,
        "rss_bytes": rss,
        "rss_over_nominal": round(rss / nominal, 4),
        "pages": pages,
        "tokens": tokens,
        "index_bytes": index,
        "per_page": {
            "host_bytes": _per(nominal, pages),
            "index_bytes": _per(index, pages),
            "rss_bytes": _per(rss, pages),
        },
        "per_token": {
            "host_bytes": _per(nominal, tokens),
            "index_bytes": _per(index, tokens),
            "rss_bytes": _per(rss, tokens),
        },
    }
    return {"node": node, "namespaces": spaces}


def index_bytes_per_page(pages: int = 4096, key_len: int = 64) -> float:
    """Index bytes a page costs, measured on a real pool of `pages` keys of `key_len`
    characters (what `sidecar plan` adds to each page's bytes)."""
    page = 64
    pool = PagePool("cost", page, page * pages)
    pool.add_segment(0)
    for i in range(pages):
        e = pool.reserve(f"{i:0{key_len}x}"[-key_len:])
        assert isinstance(e, Entry), "a new key in a pool with room: an entry"
        pool.commit(e)
    return pool_index_bytes(pool) / pages
