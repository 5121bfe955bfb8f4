"""The chaos soak's ledger: what every page is owed, and the verdict on what a sidecar serves.

A page's bytes are a function of (seed, namespace, key), so the ledger stores no payloads:

    page = shake_256("seed/namespace/key")[:page_bytes]

Each page moves through these states (times are the soak's monotonic clock):

    set sent --ack true--> acked --durable set | flush 200 | clean SIGTERM--> durable
        |                    |  \\--disk filled while not durable--> tainted (a write may fail)
        |                    `--delete (key or namespace) answered--> deleted (must stay gone)
        `--a set in flight while a delete ran: ambiguous (only its bytes are checked)

A check gets every settled page and sorts each miss into exactly one bucket: lost (durable,
or acknowledged on a sidecar whose first stop after the set was sent was a clean SIGTERM, or
that has not stopped since), allowed by design (acknowledged, not durable, and the sidecar's
first stop after the set was sent was a SIGKILL), allowed by a full disk (tainted, bounded
by the writes the sidecar counted failed), or evicted by the tier (bounded by the tier's own
eviction counter).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def payload(seed: int, namespace: str, key: str, size: int) -> bytes:
    """The deterministic bytes of one page (verifiable without storing them)."""
    return hashlib.shake_256(f"{seed}/{namespace}/{key}".encode()).digest(size)


@dataclass(slots=True)
class Page:
    ns: str
    key: str
    acked: bool = False
    acked_at: float = 0.0
    acked_start: float = 0.0  # when the set that acknowledged it was sent
    last_start: float = 0.0
    last_end: float = 0.0
    inflight: int = 0
    durable: str | None = None  # how: "flag" | "flush" (a clean stop: see `judge`)
    tainted: bool = False
    deleted_at: float | None = None
    ambiguous: bool = False


@dataclass
class Node:
    """One sidecar process (restarted in place): its policy and its history of faults."""

    name: str
    policy: str
    stops: list = field(default_factory=list)  # (time, "sigkill" | "sigterm") of each stop
    tier_evictions: int = 0  # summed over incarnations (last poll of each)
    evictions_seen: int = 0  # this incarnation's last poll
    evictions_used: int = 0
    failed: int = 0  # writer failures, summed over incarnations
    failed_seen: int = 0
    failed_used: int = 0
    dropped: int = 0
    dropped_seen: int = 0
    hf3fs_pages: int = 0  # the most a 3FS tier indexed at a poll (--tiers 3fs)

    def poll(self, stats: dict) -> None:
        """Fold one /v1/stats answer into the counters (per-incarnation values grow)."""
        ev = sum(t.get("evictions", 0) for t in stats.get("tiers", {}).values())
        wq = stats.get("write_queue", {})
        self.tier_evictions += max(0, ev - self.evictions_seen)
        self.failed += max(0, wq.get("failed", 0) - self.failed_seen)
        self.dropped += max(0, wq.get("dropped", 0) - self.dropped_seen)
        self.evictions_seen, self.failed_seen = ev, wq.get("failed", 0)
        self.dropped_seen = wq.get("dropped", 0)
        hf3fs = stats.get("tiers", {}).get("hf3fs", {}).get("pages", 0)
        self.hf3fs_pages = max(self.hf3fs_pages, hf3fs)

    def restarted(self) -> None:
        self.evictions_seen = self.failed_seen = self.dropped_seen = 0


VIOLATIONS = (
    "wrong_bytes",
    "lost_durable_flag",
    "lost_durable_flush",
    "lost_after_sigterm",
    "lost_running",
    "deleted_came_back",
    "http_5xx",
    "stalled_set_lost",
    "temps_left",
)


class Ledger:
    """Pages by (namespace, key), the nodes that hold them, and the verdict counters."""

    def __init__(self, seed: int, page_bytes: int):
        self.seed, self.page_bytes = seed, page_bytes
        self.pages: dict[tuple[str, str], Page] = {}
        self.owner: dict[str, Node] = {}  # namespace -> node
        self.counts = {k: 0 for k in VIOLATIONS}
        self.counts.update(
            allowed_sigkill=0, allowed_disk_full=0, evicted_by_tier=0, pages_checked=0, checks=0
        )
        self.examples: dict[str, list[str]] = {}
        self.by_node: dict[str, dict[str, int]] = {}  # violation -> node name -> count

    def bytes_of(self, ns: str, key: str) -> bytes:
        return payload(self.seed, ns, key, self.page_bytes)

    def note(self, what: str, detail: str, n: int = 1, node: str = "-") -> None:
        self.counts[what] = self.counts.get(what, 0) + n
        per = self.by_node.setdefault(what, {})
        per[node] = per.get(node, 0) + n
        ex = self.examples.setdefault(what, [])
        if len(ex) < 5:
            ex.append(detail)

    # -- traffic ----------------------------------------------------------------------
    def _page(self, ns: str, key: str) -> Page:
        p = self.pages.get((ns, key))
        if p is None:
            p = self.pages[(ns, key)] = Page(ns, key)
        return p

    def set_started(self, ns: str, keys, t: float) -> None:
        for k in keys:
            p = self._page(ns, k)
            p.inflight += 1
            p.last_start = max(p.last_start, t)

    def set_done(
        self, ns: str, keys, stored, start: float, t: float, durable: bool = False
    ) -> None:
        """`stored` None: the set failed (no answer); the page's fate is unknown."""
        for i, k in enumerate(keys):
            p = self._page(ns, k)
            p.inflight -= 1
            p.last_end = max(p.last_end, t)
            ok = stored is not None and stored[i]
            if p.deleted_at is not None:
                if start < p.deleted_at:
                    p.ambiguous = True  # raced with the delete: either answer is right
                    continue
                if stored is None:
                    p.ambiguous = True  # sent after the delete, fate unknown
                    continue
                p.deleted_at = None  # stored again after the delete
            if stored is None and not p.acked:
                p.ambiguous = True  # a set without an answer may have stored it
            if ok:
                if not p.acked:  # a fresh store: its own fate from here
                    p.tainted, p.durable = False, None
                p.acked, p.acked_at, p.acked_start = True, t, start
                if durable and p.durable is None:
                    p.durable = "flag"

    def deleted(self, ns: str, keys, start: float, end: float) -> None:
        """A delete (keys, or None for the whole namespace) answered at `end`."""
        pages = (
            [self._page(ns, k) for k in keys]
            if keys is not None
            else [p for p in self.pages.values() if p.ns == ns]
        )
        for p in pages:
            if p.inflight or p.last_end >= start:
                p.ambiguous = True
            p.deleted_at, p.acked, p.durable, p.tainted = start, False, None, False

    def unknown(self, ns: str, keys) -> None:
        """A delete without an answer: these pages may or may not be gone."""
        for k in keys:
            self._page(ns, k).ambiguous = True

    # -- faults -----------------------------------------------------------------------
    def _node_pages(self, node: Node):
        return (p for p in self.pages.values() if self.owner.get(p.ns) is node)

    def flushed(self, node: Node, start: float) -> int:
        """A flush that answered 200 with no new failure: pages acked before it are durable
        (write_through only: write_back keeps pages in the host pool until eviction)."""
        n = 0
        if node.policy != "write_through":
            return 0
        for p in self._node_pages(node):
            if (
                p.acked
                and not p.durable
                and not p.tainted
                and not p.inflight
                and p.last_end < start
            ):
                p.durable, n = "flush", n + 1
        return n

    def disk_filled(self) -> None:
        """The disk is full from now on: pages not yet durable may fail their write."""
        for p in self.pages.values():
            if p.acked and not p.durable:
                p.tainted = True

    def taint_since(self, t: float) -> None:
        for p in self.pages.values():
            if p.acked and not p.durable and p.acked_at >= t:
                p.tainted = True

    # -- verdicts ---------------------------------------------------------------------
    def settled(self, node: Node, before: float) -> list[Page]:
        """Pages of `node` whose state is known at `before` (no set in flight)."""
        return [
            p
            for p in self._node_pages(node)
            if not p.ambiguous
            and not p.inflight
            and p.last_end < before
            and (p.acked or p.deleted_at is not None)
        ]

    def served(self, ns: str, key: str, got) -> bool:
        """A page answered present: check its bytes (a mismatch is a violation)."""
        if bytes(got) != self.bytes_of(ns, key):
            node = self.owner.get(ns)
            self.note("wrong_bytes", f"{ns}/{key}", node=node.name if node else "-")
            return False
        return True

    def judge(self, node: Node, page: Page, present: bool) -> None:
        """Sort one settled page after a get answered `present` (bytes already checked)."""
        self.counts["pages_checked"] += 1
        where = f"{page.ns}/{page.key}"
        if page.deleted_at is not None:
            if present:
                self.note("deleted_came_back", where, node=node.name)
                page.ambiguous = True  # count it once
            return
        if present:
            if node.policy == "write_back":
                page.tainted = False  # in the host pool after the fill: written later
            return
        stop = next((how for t, how in node.stops if t > page.acked_start), None)
        if not page.durable and stop == "sigkill":
            self.counts["allowed_sigkill"] += 1  # first, so it spends no budget below
        elif node.tier_evictions > node.evictions_used:
            node.evictions_used += 1
            self.counts["evicted_by_tier"] += 1
        elif page.tainted and not page.durable and node.failed > node.failed_used:
            node.failed_used += 1  # its write may be one the sidecar counted failed
            self.counts["allowed_disk_full"] += 1
        elif page.durable:
            self.note(
                {"flag": "lost_durable_flag", "flush": "lost_durable_flush"}[page.durable],
                where,
                node=node.name,
            )
        elif stop == "sigterm":
            self.note("lost_after_sigterm", where, node=node.name)
        else:
            self.note(
                "lost_running",
                f"{where} set {page.acked_start:.2f}-{page.acked_at:.2f}s, "
                f"tainted {page.tainted}, last stop {node.stops[-1] if node.stops else None}",
                node=node.name,
            )
        page.acked, page.durable, page.tainted = False, None, False  # gone: counted once
