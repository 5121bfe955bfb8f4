"""Hybrid models through the vLLM connector: one sidecar namespace per KV cache group.

vLLM's hybrid KV cache manager (the connector is `SupportsHMA`) gives each KV cache group
its own block table: full attention keeps every block, sliding window only the blocks of
its window (the others are vLLM's null block, id 0), Mamba / linear attention one state
block, the state after the last computed token (`mamba_cache_mode align`: at a block
boundary when a step ends there). Each group is a namespace with its own pool kind and hit
rule, keyed by the same block hashes (the page of block i of every group sits under key i):

    group          pool    hit at endpoint p (p blocks restored) needs      saved
    full attention kv      pages [0, p)                        all_pages    every block
    sliding window swa     pages [p - w, p), w = window blocks trailing     every block
    Mamba          mamba   page p - 1 (the state after p blocks) trailing 1 block p-1 when a
                                                                            step ends at p

One `batch/exists` (the first full-attention group of rank 0 as the KV pool, every other
group of every rank an extra pool) answers the longest prefix every group restores: the
sidecar's intersection rule. A load moves, per group, the pages of the blocks vLLM
allocated for it (non-null) from the local hit to the hit; loads are asynchronous to vLLM
(the request waits one step), because Mamba state is copied forward before a step's
forward and because vLLM takes load failures of several groups only per request
(`failed_recving`): the request is then computed from its start, never on a torn state.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from api.engine.vllm_scheduler import Hit, SchedulerSide, Transfer
from api.engine.vllm_worker import WorkerSide

log = logging.getLogger("kv_sidecar.vllm")

FULL, SWA, MAMBA = "full", "swa", "mamba"
POOLS = {FULL: "kv", SWA: "swa", MAMBA: "mamba"}
_KINDS = {
    "FullAttentionSpec": FULL,
    "MLAAttentionSpec": FULL,
    "SlidingWindowSpec": SWA,
    "MambaSpec": MAMBA,
}
NULL_BLOCK = 0  # vLLM's null block: a skipped sliding-window block or Mamba state
FAILED = -1  # Transfer.group of a load that failed before it was planned


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group: its kind, the pages a hit needs, and its spec for the digest."""

    index: int
    kind: str  # full | swa | mamba
    window: int  # trailing pages a hit needs (0: all pages)
    block_size: int
    describe: str  # the vLLM spec and layers: part of the namespace digest

    @property
    def pool(self) -> str:
        return POOLS[self.kind]


def kind_of(spec) -> str | None:
    """The group kind of a vLLM KV cache spec (by its exact class), None if unsupported."""
    return _KINDS.get(type(spec).__name__)


def is_hybrid(kv_cache_config) -> bool:
    """Whether the groups need the per-group path (anything but one full-attention group)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return len(groups) > 1 or (
        len(groups) == 1 and kind_of(groups[0].kv_cache_spec) in (SWA, MAMBA)
    )


def plan_groups(kv_cache_config, tail: bool) -> tuple[list[GroupPlan], str]:
    """The plan of every group, or ([], why not). `tail`: a hit may end on the prompt's
    tail (a partial block), which widens a sliding window by one page."""
    plans = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = kind_of(spec)
        if kind is None:
            return [], f"group {i} is {type(spec).__name__}"
        if not getattr(group, "enable_kv_transfer", True) or not getattr(
            spec, "prefix_cacheable", True
        ):
            return [], f"group {i} is not transferable"
        bs = int(spec.block_size)
        window = 0
        if kind == SWA:
            span = (
                int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)
            )
            window = max(1, -(-span // bs)) + int(tail)
        elif kind == MAMBA:
            if getattr(spec, "mamba_cache_mode", "none") != "align":
                return [], "Mamba groups need mamba_cache_mode align (--enable-prefix-caching)"
            window = 1
        describe = f"{kind}:{spec!r}:{','.join(group.layer_names)}"
        plans.append(GroupPlan(i, kind, window, bs, describe))
    if not plans:
        return [], "no KV cache groups"
    if len({p.block_size for p in plans}) != 1:
        return [], f"groups of different block sizes {sorted({p.block_size for p in plans})}"
    if not any(p.kind in (FULL, SWA) for p in plans):
        return [], "no attention group to anchor the prefix (Mamba only)"
    return plans, ""


def anchor_of(plans: list[GroupPlan]) -> int:
    """The group whose namespace is the KV pool of `batch/exists`: the first full-attention
    group, else the first sliding-window group, held to all pages (never less than its rule)."""
    full = [p.index for p in plans if p.kind == FULL]
    return full[0] if full else next(p.index for p in plans if p.kind == SWA)


@dataclass
class HybridScheduler(SchedulerSide):
    """`SchedulerSide` with one namespace per group and rank (`ranks[r][g]`)."""

    plans: list[GroupPlan] = field(default_factory=list)
    ranks: list[list[str]] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)  # a load failed: no hit on its retry
    async_loads = True  # Mamba state is copied forward before the forward; failures per request

    def block_ids(self, groups) -> list:
        """Every group's block ids (`plan.index` picks one)."""
        return [list(ids) for ids in groups]

    @property
    def anchor(self) -> int:
        return anchor_of(self.plans)

    def extra_pools(self) -> list[dict]:
        """Every group of every rank but the KV pool, each with its hit rule."""
        extra: list[dict[str, Any]] = []
        anchor = self.anchor
        for r, names in enumerate(self.ranks):
            for plan, ns in zip(self.plans, names, strict=True):
                if r == 0 and plan.index == anchor:
                    continue
                if plan.kind == FULL or plan.index == anchor:
                    extra.append({"namespace": ns, "policy": "all_pages"})
                else:
                    extra.append(
                        {"namespace": ns, "policy": "trailing_pages", "window": plan.window}
                    )
        return extra

    def _exists_once(self, keys: list[str]) -> int:
        kv = self.ranks[0][self.anchor]
        return int(self.client.batch_exists(keys, kv, self.extra_pools())["hit"])

    def matched(self, request, num_computed: int) -> int | None:
        if request.request_id in self.failed:  # asked again after its load failed: compute
            self.hits[request.request_id] = Hit(num_computed, None)
            return 0
        return super().matched(request, num_computed)

    def _queue_load(self, rid: str, keys: list[str], index: range, block_ids) -> None:
        """One transfer per group (an empty one too: the worker reports every request
        whose load it was handed): the blocks vLLM allocated, null blocks skipped."""
        for plan in self.plans:
            ids = block_ids[plan.index]
            pick = [i for i in index if i < len(ids) and ids[i] != NULL_BLOCK]
            self.loads.append(
                Transfer(rid, [keys[i] for i in pick], [ids[i] for i in pick], group=plan.index)
            )

    def fail_load(self, rid: str, block_ids: list) -> None:
        """Report the request's load as failed, as a whole (its plan could not be made)."""
        self.loads.append(Transfer(rid, [], [], group=FAILED))

    def _save_transfers(
        self, req, keys: list[str], index: list[int], end: int, block_ids_of
    ) -> list[Transfer]:
        """Per group: every block with a real id; Mamba only the block whose state is at
        the step's end, when that is a block boundary. KV events ride on the anchor's."""
        groups = block_ids_of(req.request_id)
        out = []
        for plan in self.plans:
            ids = groups[plan.index]
            pick = [
                (k, i)
                for k, i in zip(keys, index, strict=True)
                if i < len(ids) and ids[i] != NULL_BLOCK
            ]
            if plan.kind == MAMBA:
                pick = [(k, i) for k, i in pick if (i + 1) * self.block_size == end]
            if not pick:
                continue
            t = Transfer(
                req.request_id, [k for k, _ in pick], [ids[i] for _, i in pick], group=plan.index
            )
            out.append(self._with_meta(t, req, pick[0][1]) if plan.index == self.anchor else t)
        return out

    def loads_failed(self, rids: set[str]) -> None:
        """As `SchedulerSide`'s, and their retry gets no hit (it computes)."""
        self.failed |= rids
        super().loads_failed(rids)

    def load_failed(self, invalid: set[int], block_ids_of) -> None:
        """Not reported for several groups: vLLM takes their failures per request."""

    def finished(self, request) -> None:
        self.failed.discard(request.request_id)
        super().finished(request)


class HybridWorker:
    """One `WorkerSide` per group; a request's load is reported once handed over (failed
    when any group's failed); saves hold no blocks, so none is reported."""

    def __init__(self, sides: list[WorkerSide]):
        self.sides = sides
        self.lock = threading.Lock()
        self.received: set[str] = set()
        self.failed: set[str] = set()

    @property
    def groups(self) -> list[tuple[str, dict]]:
        return [(s.namespace, s.spec) for s in self.sides]

    def load(self, transfers: list[Transfer]) -> None:
        failed = {t.req_id for t in transfers if t.group == FAILED}
        for g, side in enumerate(self.sides):
            side.load([t for t in transfers if t.group == g])
            failed |= side.failed_reqs
            side.take_load_errors()  # several groups: vLLM takes failures per request
        with self.lock:
            self.received |= {t.req_id for t in transfers}
            self.failed |= failed

    def save(self, transfers: list[Transfer]) -> None:
        for g, side in enumerate(self.sides):
            side.save([t for t in transfers if t.group == g])

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(saves done: none, no request's blocks wait for its sets; loads done, loads
        failed: a failed load is also done)."""
        with self.lock:
            received, self.received = self.received, set()
            failed, self.failed = self.failed & received, self.failed - received
        return set(), received, failed

    def close(self) -> None:
        for side in self.sides:
            side.close()


def transfer_results_type() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults
