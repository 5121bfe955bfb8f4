"""Scheduler side of the vLLM connector: how much of a prompt the sidecar holds, and which
blocks each step loads and saves.

    request.block_hashes  h0   h1   h2   h3   h4 | t   (prompt: 5 full blocks + 7 tokens)
    local prefix cache    [h0] [h1]              |     num_computed_tokens = 2 blocks
    one exists call       [h0 .. h4, t]  ------> prefix 6: load blocks 2, 3, 4 and the tail
                                                  t: every token but the last (vLLM computes it)
    after the step: blocks 5.. are saved once, when full and computed; the tail t (the
    prompt's partial last block, under its own key) once the whole prompt is computed

With `tail_key` (the connector passes one built on vLLM's block hash) the block holding the
prompt's last token loads too: under its vLLM key when the prompt ends on a block boundary,
else under the tail key (when it holds 2 tokens or more: a 1-token tail saves nothing).
Without it, that block is never claimed (the rule before issue 33).

The exists call starts when the request arrives (`prefetch`, vLLM's `on_new_request`) and
runs on a worker thread: by the time the scheduler asks, the answer is usually there. The
scheduler waits for it at least `lookup_wait_ms` and up to `LOOKUP_STEP_SHARE` of the step
the request would join: the steps' mean length (`step_s`; 1 s before one is timed) or, if
longer, its own uncomputed tokens (at most a step's budget) at the steps' seconds a token
(`token_s`). Answering None costs the request a whole step (vLLM asks again on the next
one, seconds away when prefills fill the batch; a mean of short decode steps once let a
6 ms answer lose a 9.6 s step), waiting costs the batch only the wait. An answer later
than `lookup_timeout_ms` counts as a miss. Every failure is a miss (0), never an exception.

With `cost` (api/engine/restore_cost.py), the exists call also says where the prefix lies
(host pool, local tier, remote) and a prefix loads only when restoring it is expected to
beat computing it: else the engine recomputes (its host-pool run may still load) and the
sidecar is told (`restores_skipped`). The worker's timings feed the estimates back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from api.engine.client import SidecarClient, SidecarError
from api.engine.restore_cost import RestoreCost, by_tier
from api.engine.vllm_layout import block_keys
from api.engine.vllm_timeline import OFF, Timeline

LOOKUP_STEP_SHARE = 0.05  # of a step, the longest wait for a late exists answer
LOOKUP_REFRESH_S = 0.5  # an answer older than this (not a whole hit) is asked again
STEP_EWMA = 0.2  # weight of the newest step in `step_s`
STEP_PRIOR_S = 1.0  # the step length assumed before one is timed (a burst at start)

log = logging.getLogger("kv_sidecar.vllm")


@dataclass
class Transfer:
    """Pages of one request to move this step: keys[i] <-> KV block block_ids[i]."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    parent: str | None = None  # KV events: the key before keys[0]
    tokens: list[list[int]] | None = None  # KV events: each key's token ids (saves)
    group: int = 0  # the KV cache group (hybrid models)
    tiers: dict[str, int] | None = None  # loads: bytes by serving tier (restore cost)


@dataclass
class Lookup:
    future: Future
    started: float
    keys: list[str]
    tokens: int  # the request's tokens when asked: a load stops one short of them
    tail: bool  # keys[-1] is the tail key (the partial block of the last token)
    answered: float = 0.0  # when the answer came (the timeline's `exists_s`)
    before: Where | None = None  # a refresh's: the answer it replaces, while it is late

    def stamp(self, _: Future) -> None:
        """The answer is in (the future's done callback)."""
        self.answered = time.monotonic()


@dataclass
class Hit:
    """What `matched` learned: vLLM's own (block-aligned) tokens and the sidecar's prefix
    (None: not asked, or not answered yet, because nothing past vLLM's own could load)."""

    local: int
    present: int | None


@dataclass
class Tail:
    index: int  # block index of the partial block
    key: str
    end: int  # the prompt's tokens: the tail is complete once they are computed
    saved: bool  # the sidecar holds it (found, or saved by this request)


@dataclass
class Tracked:
    """A scheduled request: its Request object and how many leading blocks are stored."""

    request: Any
    stored: int = 0
    tail: Tail | None = None


Where = tuple[int, int, int]  # (prefix, of it in the host pool, in the host pool or a local tier)


def _where(answer) -> Where:
    """An exists answer as `Where` (a bare prefix: all of it in the host pool, as far as known)."""
    if isinstance(answer, tuple):
        return answer
    return int(answer), int(answer), int(answer)


def _ewma(mean: float, sample: float) -> float:
    """`mean` moved `STEP_EWMA` towards `sample` (the first sample: itself). An idle gap is
    no step: a sample counts at most twice the mean."""
    if not mean:
        return sample
    return (1 - STEP_EWMA) * mean + STEP_EWMA * min(sample, 2 * mean)


def _where_of(future: Future) -> Where | None:
    """A finished lookup's answer (None: cancelled)."""
    try:
        return future.result(timeout=0)
    except BaseException:
        return None


def _answer(future: Future) -> int | None:
    """The lookup's answer if it is in (a failed or cancelled lookup is a miss), else None."""
    if not future.done():
        return None
    try:
        return int(future.result()[0])
    except BaseException:
        return 0


@dataclass
class SchedulerSide:
    client: SidecarClient
    block_size: int
    ratio: int = 1  # KV block size / hash block size
    lookup_wait: float = 0.002
    lookup_timeout: float = 1.0
    lookup_refresh: float = LOOKUP_REFRESH_S
    tail_key: Callable[[Any, int], str | None] | None = None  # (request, full blocks) -> key
    cost: RestoreCost | None = None  # load only what restores faster than it computes
    specs: dict[str, dict] = field(default_factory=dict)  # namespace -> spec, rank order
    lookups: dict[str, Lookup] = field(default_factory=dict)
    hits: dict[str, Hit] = field(default_factory=dict)
    tracked: dict[str, Tracked] = field(default_factory=dict)
    loads: list[Transfer] = field(default_factory=list)
    stats: dict[str, int] = field(
        default_factory=lambda: {
            "lookups": 0,
            "late": 0,
            "load_blocks": 0,
            "skipped": 0,
            "refreshed": 0,
        }
    )
    tiers: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # rid -> its load's bytes by tier
    skipped: set[str] = field(default_factory=set)  # rids whose skip was reported
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, "sidecar-exists")
    )
    async_loads = False  # loads land in the step's forward (hybrid: a step later)
    timeline: Timeline = OFF  # where the time goes (bench-serve's breakdown)
    late: dict[str, list] = field(default_factory=dict)  # rid -> [first late ask, steps]
    step_s: float = 0.0  # the steps' mean length (EWMA of the time between two)
    token_s: float = 0.0  # a scheduled token's mean seconds (EWMA, per step)
    step_tokens: int = 0  # a step's token budget (vLLM's max_num_batched_tokens; 0: none)
    _stepped: float = 0.0  # when the last step's metadata was built
    _step_load: int = 0  # the tokens that step scheduled

    def block_ids(self, groups) -> list:
        """The block ids this side plans with, from vLLM's per-group lists: the one group's."""
        return list(groups[0])

    # -- lookups ----------------------------------------------------------------------
    def keys_of(self, request) -> tuple[list[str], bool]:
        """The keys to ask for, and whether the last one is the tail key."""
        n, bs = request.num_tokens, self.block_size
        if self.tail_key is None:
            return block_keys(request.block_hashes, self.ratio, (n - 1) // bs), False
        full = n // bs
        keys = block_keys(request.block_hashes, self.ratio, full)
        if len(keys) == full and n - full * bs >= 2:
            tail = self.tail_key(request, full)
            if tail:
                return keys + [tail], True
        return keys, False

    def prefetch(self, request) -> None:
        """Start the lookup as the request arrives (vLLM's `on_new_request`)."""
        if self.specs and request.request_id not in self.lookups:
            self._start(request)

    def _start(self, request) -> Lookup | None:
        keys, tail = self.keys_of(request)
        if not keys:
            return None
        look = Lookup(
            self.pool.submit(self._exists, keys), time.monotonic(), keys, request.num_tokens, tail
        )
        look.future.add_done_callback(look.stamp)
        self.lookups[request.request_id] = look
        self.stats["lookups"] += 1
        return look

    def _loadable(self, look: Lookup, present: int) -> int:
        """Tokens the first `present` keys give: never the last token (vLLM computes it)."""
        return min(present * self.block_size, look.tokens - 1)

    def matched(self, request, num_computed: int) -> int | None:
        """Tokens beyond `num_computed` the sidecar can load; None while the answer is late."""
        if not self.specs:
            return 0
        rid = request.request_id
        look = self.lookups.get(rid)
        if look is not None and look.tokens != request.num_tokens:  # resumed with more tokens
            look.future.cancel()
            look = None
        if look is None:
            look = self._start(request)
        if look is None or self._loadable(look, len(look.keys)) <= num_computed:
            self.hits[rid] = Hit(num_computed, None)  # nothing past vLLM's own blocks to load
            return 0
        look = self._fresh(request, look)
        where: Where = (0, 0, 0)
        try:
            where = look.future.result(timeout=self.wait_s(look.tokens - num_computed))
        except FutureTimeout:
            if look.before is not None:  # a late refresh: the answer it replaces
                where = look.before
            elif time.monotonic() - look.started < self.lookup_timeout:
                self.stats["late"] += 1
                self.late.setdefault(rid, [time.monotonic(), 0])[1] += 1
                return None
            else:
                log.warning(
                    "kv-sidecar exists took over %.0f ms: a miss", self.lookup_timeout * 1e3
                )
        except BaseException:  # cancelled
            pass
        present = where[0]
        self.hits[rid] = Hit(num_computed, present)
        self._time_lookup(request, look, present)
        tokens = max(self._loadable(look, present) - num_computed, 0)
        return (
            self._worth(rid, look, where, num_computed, tokens) if tokens and self.cost else tokens
        )

    def _fresh(self, request, look: Lookup) -> Lookup:
        """`look`, or where its answer is older than `lookup_refresh` and not a whole hit,
        the same keys asked again: a request that waited in the queue (seconds, on a busy
        CPU fleet) was looked up on arrival, and the turn before it may have stored its
        pages since. The new lookup keeps the old answer for while it is late."""
        if not look.answered or time.monotonic() - look.answered < self.lookup_refresh:
            return look
        old = _where_of(look.future)
        if old is None or old[0] >= len(look.keys):
            return look
        new = self._start(request)
        if new is None:
            return look
        new.before = old
        self.stats["refreshed"] += 1
        return new

    def _time_lookup(self, request, look: Lookup, present: int) -> None:
        """The timeline's row: how long the request waited for the answer, in steps, and
        how long the exists call took from its start (0: not in when asked)."""
        since, steps = self.late.pop(request.request_id, (0.0, 0))
        if self.timeline.on:
            self.timeline.add(
                "request",
                lookup_s=time.monotonic() - since if steps else 0.0,
                exists_s=look.answered - look.started if look.answered else 0.0,
                late_steps=steps,
                hit_tokens=present * self.block_size,
                prompt_tokens=request.num_tokens,
            )

    def _worth(self, rid: str, look: Lookup, where: Where, start: int, tokens: int) -> int:
        """Of `tokens` loadable past `start`, those worth loading (`cost`): all of them,
        the host pool's run, or none; a load not made in full is reported skipped."""
        try:
            assert self.cost is not None, "`matched` weighs loads only with a restore cost"
            present, host, local = where
            page = next(iter(self.specs.values()))["page_bytes"]
            bs = self.block_size
            first = start // bs
            options = [(tokens, by_tier(-(-(start + tokens) // bs), host, local, page, first))]
            short = self._loadable(look, host) - start
            if 0 < short < tokens:
                options.append(
                    (short, by_tier(-(-(start + short) // bs), host, local, page, first))
                )
            chosen = self.cost.choose(options)
            self.tiers[rid] = dict(next(b for t, b in options if t == chosen)) if chosen else {}
            if chosen < tokens and rid not in self.skipped:
                self.skipped.add(rid)
                self.stats["skipped"] += 1
                pages = -(-(start + tokens) // bs) - (-(-(start + chosen) // bs))
                self.pool.submit(self._report_skip, pages)
            return chosen
        except Exception:
            log.exception("kv-sidecar restore cost failed: the request recomputes")
            return 0

    def _report_skip(self, pages: int) -> None:
        try:
            self.client.skipped(next(iter(self.specs)), 1, pages)
        except Exception as exc:
            log.debug("kv-sidecar: reporting a skipped restore failed: %s", exc)

    def _exists(self, keys: list[str]) -> Where:
        """Stored prefix present in every rank's namespace: one call, never per block."""
        try:
            started = time.monotonic()
            where = _where(self._exists_once(keys))
            if self.cost is not None:
                self.cost.observe_rtt(time.monotonic() - started)
            return where
        except SidecarError as exc:
            if exc.code != "namespace_not_found":
                log.warning("kv-sidecar exists failed (a miss): %s", exc)
                return 0, 0, 0
        try:  # the sidecar restarted: register the namespaces again, ask once more
            for ns, spec in self.specs.items():
                self.client.put_namespace(ns, **spec)
            return _where(self._exists_once(keys))
        except Exception as exc:
            log.warning("kv-sidecar exists failed (a miss): %s", exc)
            return 0, 0, 0

    def _exists_once(self, keys: list[str]):
        """The prefix (int), or with `cost` and one namespace where it lies (`Where`)."""
        names = list(self.specs)
        if len(names) == 1:
            if self.cost is not None:
                return self.client.exists_where(names[0], keys)
            return int(self.client.exists(names[0], keys))
        extra = [{"namespace": n, "policy": "all_pages"} for n in names[1:]]
        return int(self.client.batch_exists(keys, names[0], extra)["hit"])

    # -- allocation and the step's metadata -------------------------------------------
    def allocated(self, request, block_ids: list[int], num_external: int) -> None:
        """Blocks are allocated: queue the load of the external tokens, start tracking.
        What the sidecar holds decides what is saved later: its prefix when the answer is
        in, else vLLM's own cached blocks (computed here and saved then, or loaded)."""
        rid = request.request_id
        look = self.lookups.pop(rid, None)
        hit = self.hits.pop(rid, None)
        t = self.tracked.setdefault(rid, Tracked(request))
        t.request = request
        if hit is None:
            return
        present = hit.present
        if present is None and look is not None:
            present = _answer(look.future)
            if present is None:
                look.future.cancel()
        bs = self.block_size
        full_keys = len(look.keys) - int(look.tail) if look is not None else 0
        stored = hit.local // bs if present is None else min(present, full_keys)
        t.stored = max(t.stored, stored)
        if look is not None and look.tail:
            t.tail = Tail(
                full_keys, look.keys[-1], look.tokens, saved=bool(present and present > full_keys)
            )
        if num_external <= 0 or look is None:
            return
        first, last = hit.local // bs, -(-(hit.local + num_external) // bs)
        assert hit.local % bs == 0 and present is not None and last <= present, (hit, num_external)
        self._queue_load(rid, look.keys, range(first, last), block_ids)
        if self.loads:
            self.loads[-1].tiers = self.tiers.pop(rid, None)
        self.stats["load_blocks"] += last - first

    def _queue_load(self, rid: str, keys: list[str], index: range, block_ids) -> None:
        """Queue the load of keys[i] into block_ids[i] for i in `index`."""
        self.loads.append(
            Transfer(rid, keys[index.start : index.stop], list(block_ids[index.start : index.stop]))
        )

    def fail_load(self, rid: str, block_ids: list[int]) -> None:
        """Its load could not be planned: every block is reported failed (vLLM recomputes)."""
        self.loads.append(Transfer(rid, [], block_ids))

    def wait_s(self, tokens: int = 0) -> float:
        """How long `matched` waits for a late answer: `lookup_wait`, or up to
        `LOOKUP_STEP_SHARE` of the step a request of `tokens` uncomputed tokens would join
        (never past the timeout)."""
        if self.step_tokens:
            tokens = min(tokens, self.step_tokens)
        step = max(self.step_s or STEP_PRIOR_S, tokens * self.token_s)
        return max(self.lookup_wait, min(LOOKUP_STEP_SHARE * step, self.lookup_timeout))

    def take_loads(self, tokens: int = 0) -> list[Transfer]:
        """The step's loads (called once a step, which schedules `tokens`: it also times
        the steps, and the last one's seconds a token)."""
        now = time.monotonic()
        if self._stepped:
            took = now - self._stepped
            self.step_s = _ewma(self.step_s, took)
            if self._step_load:
                self.token_s = _ewma(self.token_s, took / self._step_load)
        self._stepped, self._step_load = now, tokens
        loads, self.loads = self.loads, []
        return loads

    def saves(self, scheduled: dict[str, int], block_ids_of) -> list[Transfer]:
        """This step's saves: full blocks computed by the end of it, each once per request
        (blocks the sidecar already holds are skipped), and the prompt's tail once the
        prompt is computed."""
        saves = []
        for rid, n in scheduled.items():
            t = self.tracked.get(rid)
            if t is None:
                continue
            keys, index, end = self._save_plan(t, n)
            if keys:
                transfers = self._save_transfers(t.request, keys, index, end, block_ids_of)
                saves += transfers
        return saves

    def _save_plan(self, t: Tracked, n: int) -> tuple[list[str], list[int], int]:
        """The keys to save after a step of `n` tokens, their block indices (ascending, one
        run), and the tokens computed by the end of the step."""
        req = t.request
        end = req.num_computed_tokens + n
        done = min(end, req.num_tokens) // self.block_size
        keys: list[str] = []
        index: list[int] = []
        if done > t.stored:
            full = block_keys(req.block_hashes, self.ratio, done)
            if len(full) > t.stored:
                keys, index = full[t.stored :], list(range(t.stored, len(full)))
                t.stored = len(full)
        tail = t.tail
        if tail is not None and not tail.saved and end >= tail.end and t.stored >= tail.index:
            keys.append(tail.key)
            index.append(tail.index)
            tail.saved = True
        return keys, index, end

    def _save_transfers(
        self, req, keys: list[str], index: list[int], end: int, block_ids_of
    ) -> list[Transfer]:
        ids = block_ids_of(req.request_id)
        n = sum(1 for i in index if i < len(ids))
        if not n:
            return []
        t = Transfer(req.request_id, keys[:n], [ids[i] for i in index[:n]])
        return [self._with_meta(t, req, index[0])]

    def _with_meta(self, t: Transfer, req, first: int) -> Transfer:
        """What KV events need (docs/kv-events.md): the parent key and each block's tokens
        (a tail's: the prompt's last, partial block). Never fails a save."""
        try:
            if first:
                t.parent = block_keys(req.block_hashes, self.ratio, first)[first - 1]
            ids, bs = req.all_token_ids, self.block_size
            t.tokens = [
                list(ids[(first + i) * bs : min((first + i + 1) * bs, req.num_tokens)])
                for i in range(len(t.keys))
            ]
        except Exception:
            t.parent, t.tokens = None, None
        return t

    def load_failed(self, invalid: set[int], block_ids_of) -> None:
        """Blocks that did not load are recomputed by vLLM: save them (and what follows) again."""
        for rid, t in self.tracked.items():
            try:
                blocks = block_ids_of(rid)
            except Exception:  # preempted: no blocks now, nothing of it was computed on them
                continue
            first = next((i for i, b in enumerate(blocks[: t.stored]) if b in invalid), None)
            if first is not None:
                t.stored = first
            tail = t.tail
            if tail is not None and tail.index < len(blocks) and blocks[tail.index] in invalid:
                tail.saved = False

    def loads_failed(self, rids: set[str]) -> None:
        """Requests whose whole load failed (`failed_recving`): vLLM computes them from their
        start, so every block is saved again."""
        for rid in rids:
            t = self.tracked.get(rid)
            if t is not None:
                t.stored = 0
                if t.tail is not None:
                    t.tail.saved = False

    def finished(self, request) -> None:
        """Forget the request. Its blocks are free at once: the step's saves copied them out
        (CPU) or the set read them within the step (CUDA), so nothing delays their release."""
        rid = request.request_id
        look = self.lookups.pop(rid, None)
        if look is not None:
            look.future.cancel()
        self.hits.pop(rid, None)
        self.tiers.pop(rid, None)
        self.skipped.discard(rid)
        self.late.pop(rid, None)
        self.tracked.pop(rid, None)

    # -- restore cost -----------------------------------------------------------------
    def prefill_tokens(self, scheduled: dict[str, int]) -> int:
        """Prompt tokens a step computes, when they are most of it (else 0: a decode step
        times no prefill)."""
        prompt = 0
        for rid, n in scheduled.items():
            t = self.tracked.get(rid)
            if t is not None and t.request.num_computed_tokens < t.request.num_prompt_tokens:
                prompt += n
        total = sum(scheduled.values())
        return prompt if prompt >= self.block_size and 2 * prompt >= total else 0

    def observe(self, timings: dict) -> None:
        """The worker's timings (`WorkerSide.take_timings`) into the restore cost."""
        cost = self.cost
        if cost is None:  # no restore cost: nothing learns from them
            return
        for tokens, seconds in timings.get("prefill", ()):
            cost.observe_prefill(int(tokens), float(seconds))
        for tiers, seconds in timings.get("restores", ()):
            cost.observe_restore({str(k): int(v) for k, v in dict(tiers).items()}, float(seconds))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
