"""Scheduler side of the vLLM connector: how much of a prompt the sidecar holds, and which
blocks each step loads and saves.

    request.block_hashes  h0   h1   h2   h3   h4 |  (prompt: 5 full blocks + 7 tokens)
    local prefix cache    [h0] [h1]              |  num_computed_tokens = 2 blocks
    one exists call            [h0 .. h4]  ----> prefix 4: load blocks 2, 3 (never the
                                                  block holding the prompt's last token)
    after the step: blocks 4.. are saved once, when full and computed

The exists call runs on a worker thread: the scheduler loop waits at most `lookup_wait_ms`
for it and otherwise answers None (vLLM asks again next step); an answer later than
`lookup_timeout_ms` counts as a miss. Every failure is a miss (0), never an exception.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Optional

from api.engine.client import SidecarClient, SidecarError
from api.engine.vllm_layout import block_keys

log = logging.getLogger("kv_sidecar.vllm")


@dataclass
class Transfer:
    """Pages of one request to move this step: keys[i] <-> KV block block_ids[i]."""

    req_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class Lookup:
    future: Future
    started: float
    keys: list[str]


@dataclass
class Tracked:
    """A scheduled request: its Request object and how many leading blocks are stored."""

    request: Any
    stored: int = 0
    saving: bool = False


@dataclass
class SchedulerSide:
    client: SidecarClient
    block_size: int
    ratio: int = 1                      # KV block size / hash block size
    lookup_wait: float = 0.002
    lookup_timeout: float = 1.0
    specs: dict[str, dict] = field(default_factory=dict)    # namespace -> spec, rank order
    lookups: dict[str, Lookup] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)       # req_id -> stored blocks
    tracked: dict[str, Tracked] = field(default_factory=dict)
    loads: list[Transfer] = field(default_factory=list)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "sidecar-exists"))

    # -- lookups ----------------------------------------------------------------------
    def matched(self, request, num_computed: int) -> Optional[int]:
        """Tokens beyond `num_computed` the sidecar can load; None while the answer is late."""
        if not self.specs:
            return 0
        limit = (request.num_tokens - 1) // self.block_size   # never the last token
        rid = request.request_id
        look = self.lookups.get(rid)
        if look is None:
            keys = block_keys(request.block_hashes, self.ratio, limit)
            if len(keys) * self.block_size <= num_computed:
                return 0
            look = Lookup(self.pool.submit(self._exists, keys), time.monotonic(), keys)
            self.lookups[rid] = look
        try:
            hit = look.future.result(timeout=self.lookup_wait)
        except FutureTimeout:
            if time.monotonic() - look.started < self.lookup_timeout:
                return None
            log.warning("kv-sidecar exists took over %.0f ms: a miss", self.lookup_timeout * 1e3)
            hit = 0
        self.hits[rid] = hit = min(hit, limit)
        return max(hit * self.block_size - num_computed, 0)

    def _exists(self, keys: list[str]) -> int:
        """Stored prefix present in every rank's namespace: one call, never per block."""
        try:
            return self._exists_once(keys)
        except SidecarError as exc:
            if exc.code != "namespace_not_found":
                log.warning("kv-sidecar exists failed (a miss): %s", exc)
                return 0
        try:  # the sidecar restarted: register the namespaces again, ask once more
            for ns, spec in self.specs.items():
                self.client.put_namespace(ns, **spec)
            return self._exists_once(keys)
        except Exception as exc:
            log.warning("kv-sidecar exists failed (a miss): %s", exc)
            return 0

    def _exists_once(self, keys: list[str]) -> int:
        names = list(self.specs)
        if len(names) == 1:
            return int(self.client.exists(names[0], keys))
        extra = [{"namespace": n, "policy": "all_pages"} for n in names[1:]]
        return int(self.client.batch_exists(keys, names[0], extra)["hit"])

    # -- allocation and the step's metadata -------------------------------------------
    def allocated(self, request, block_ids: list[int], num_external: int) -> None:
        """Blocks are allocated: queue the load of the external tokens, start tracking."""
        rid = request.request_id
        look = self.lookups.pop(rid, None)
        hit = self.hits.pop(rid, 0)
        t = self.tracked.setdefault(rid, Tracked(request))
        t.request = request
        t.stored = max(t.stored, hit)
        if num_external <= 0 or look is None:
            return
        n = num_external // self.block_size
        assert n * self.block_size == num_external and n <= hit, (num_external, hit)
        self.loads.append(Transfer(rid, look.keys[hit - n:hit], list(block_ids[hit - n:hit])))

    def take_loads(self) -> list[Transfer]:
        loads, self.loads = self.loads, []
        return loads

    def saves(self, scheduled: dict[str, int], block_ids_of) -> list[Transfer]:
        """This step's saves: full blocks computed by the end of it, each once per request
        (blocks the sidecar already holds are skipped)."""
        saves = []
        for rid, n in scheduled.items():
            t = self.tracked.get(rid)
            if t is None:
                continue
            req = t.request
            done = min(req.num_computed_tokens + n, req.num_tokens) // self.block_size
            if done <= t.stored:
                continue
            keys = block_keys(req.block_hashes, self.ratio, done)
            if len(keys) <= t.stored:
                continue
            blocks = block_ids_of(rid)
            saves.append(Transfer(rid, keys[t.stored:], list(blocks[t.stored:len(keys)])))
            t.stored, t.saving = len(keys), True
        return saves

    def load_failed(self, invalid: set[int], block_ids_of) -> None:
        """Blocks that did not load are recomputed by vLLM: save them (and what follows) again."""
        for rid, t in self.tracked.items():
            try:
                blocks = block_ids_of(rid)
            except Exception:  # preempted: no blocks now, nothing of it was computed on them
                continue
            first = next((i for i, b in enumerate(blocks[:t.stored]) if b in invalid), None)
            if first is not None:
                t.stored = first

    def finished(self, request) -> bool:
        """Forget the request; True when saves were scheduled (the worker reports them)."""
        rid = request.request_id
        look = self.lookups.pop(rid, None)
        if look is not None:
            look.future.cancel()
        self.hits.pop(rid, None)
        t = self.tracked.pop(rid, None)
        return bool(t and t.saving)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
