"""The curated mutation check: break one rule at a time in a copy of the tree and make sure
the tests named for it notice (issue 18).

Each mutant is (name, file, exact original snippet, replacement, tests: pytest arguments,
node ids or "-k", "expr"). The snippet must
occur exactly once in the file: when the code changes under it, the check fails until the
list is updated (so it stays maintained). Every mutant runs only its own tests, with -x, in
a temporary copy of the tree (never the working tree):

    caught    the tests failed (pytest exit 1)
    SURVIVED  the tests passed: the rule is unguarded
    ERROR     the snippet is missing/ambiguous, or pytest could not run the tests

    python scripts/mutants.py            # all; exit 1 unless every mutant is caught
    python scripts/mutants.py -k auth    # only mutants whose name contains "auth"
    python scripts/mutants.py --list
    python scripts/mutants.py --tests-from REV   # survey: the tests of an older revision

A mutant whose tests hang is caught by the timeout (--timeout, per mutant). Keep each
mutant's tests narrow: the whole list must stay under about 3 minutes in CI.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    original: str
    replacement: str
    tests: tuple[str, ...]


M = Mutant
MUTANTS = [
    # -- the token: every route but /healthz (README, issue 18) ---------------------------
    M(
        "auth: a request without Authorization let through",
        "api/guard.py",
        "role = self.credentials.role(auth) if auth is not None else None",
        "role = self.credentials.role(auth) if auth is not None else OPERATOR",
        ("tests/api/test_errors.py::test_token_guards_every_route_but_healthz",),
    ),
    M(
        "auth: /metrics open with a token",
        "api/guard.py",
        'OPEN_PATHS = ("/healthz",)',
        'OPEN_PATHS = ("/healthz", "/metrics")',
        ("tests/api/test_errors.py::test_token_guards_every_route_but_healthz",),
    ),
    M(
        "auth: /readyz open with a token",
        "api/guard.py",
        'OPEN_PATHS = ("/healthz",)',
        'OPEN_PATHS = ("/healthz", "/readyz")',
        ("tests/api/test_errors.py::test_token_guards_every_route_but_healthz",),
    ),
    M(
        "auth: /openapi.json open with a token",
        "api/guard.py",
        'OPEN_PATHS = ("/healthz",)',
        'OPEN_PATHS = ("/healthz", "/openapi.json")',
        ("tests/api/test_errors.py::test_token_guards_every_route_but_healthz",),
    ),
    # -- keys: the batch check agrees with the one-key check ----------------------------
    M(
        "keys: a stride mismatch refuses a valid mixed-length batch",
        "sidecar/keys.py",
        "    if stride and raw[size :: size + 1] == _SEPARATORS[: n - 1]:\n        return True",
        "    if stride:\n        return raw[size :: size + 1] == _SEPARATORS[: n - 1]",
        ("tests/sidecar/test_keys.py::test_examples",),
    ),
    M(
        "keys: the stride shortcut skips the characters' check",
        "sidecar/keys.py",
        "    if raw.translate(None, _ALLOWED) != _SEPARATORS[: n - 1]:",
        "    if False:",
        ("tests/sidecar/test_keys.py",),
    ),
    # -- pages on disk: verify on read ---------------------------------------------------
    M(
        "pagefile: the header's own checksum not checked",
        "sidecar/tiers/pagefile.py",
        "if head_sum != xxhash.xxh3_64_intdigest(raw[: HEADER.size]):",
        "if False:",
        ("tests/sidecar/tiers/test_file_tier.py", "-k", "header_sum"),
    ),
    M(
        "pagefile: the page checksum not checked (page cache read)",
        "sidecar/tiers/pagefile.py",
        "        os.close(fd)\n    return xxhash.xxh3_64_intdigest(dst) == digest",
        "        os.close(fd)\n    return True",
        ("tests/sidecar/tiers/test_file_tier.py",),
    ),
    M(
        "file tier: a rescan counts pages a batch renamed but has not indexed",
        "sidecar/tiers/file_tier.py",
        "for ident, key in changed.keys() | self._publishing.keys():",
        "for ident, key in changed.keys():",
        ("tests/sidecar/tiers/test_file_tier.py", "-k", "rescan"),
    ),
    # -- the host pool: exists never moves a page; pins ------------------------------------
    M(
        "pool: prefix (exists) touches the LRU",
        "pools/page_pool.py",
        "        return run_length(self.ready, keys)",
        "        [self.lru.touch(self.ready[k]) for k in keys if k in self.ready]\n"
        "        return run_length(self.ready, keys)",
        ("tests/api/test_endpoints.py::test_exists_does_not_refresh_pages",),
    ),
    M(
        "pool: prefix's one look-up runs past a miss",
        "pools/page_pool.py",
        "            return keys.index(miss.args[0])",
        "            return len(keys) - 1",
        ("tests/pools/test_page_pool.py::test_prefix_on_both_paths",),
    ),
    M(
        "pool: present (exists_each) touches the LRU",
        "pools/page_pool.py",
        "return list(map(self.ready.__contains__, keys))",
        "out = list(map(self.ready.__contains__, keys))\n"
        "        [self.lru.touch(self.ready[k]) for k, h in zip(keys, out) if h]\n        return out",
        ("tests/api/test_endpoints.py::test_exists_does_not_refresh_pages",),
    ),
    M(
        "pool: a get does not refresh its pages (the last unpin puts a page back as the oldest)",
        "pools/page_pool.py",
        "                return\n            self.lru.push_mru(e)\n",
        "                return\n            h = self.lru._head\n            e.prev, e.next = h, h.next\n"
        "            h.next.prev = e\n            h.next = e\n            self.lru._len += 1\n",
        ("tests/pools/test_page_pool.py::test_the_last_unpin_makes_a_page_the_newest",),
    ),
    M(
        "pool: eviction ignores pins",
        "pools/page_pool.py",
        "        for e in islice(self.lru.from_lru(), EVICT_SCAN):",
        "        for e in islice(list(self.ready.values()), EVICT_SCAN):",
        ("tests/pools/test_page_pool.py",),
    ),
    M(
        "pool: an eviction walks every page on_evict keeps",
        "pools/page_pool.py",
        "        for e in islice(self.lru.from_lru(), EVICT_SCAN):\n            if self._evict(e):",
        "        for e in self.lru.from_lru():\n            if self._evict(e):",
        ("tests/pools/test_page_pool.py::test_eviction_passes_over_at_most_evict_scan_kept_pages",),
    ),
    M(
        "pool: a reclaim empties a segment with a busy slot",
        "pools/page_pool.py",
        "            if seg in self._seg_busy:\n                continue",
        "            if False:\n                continue",
        ("tests/pools/test_page_pool.py::test_reclaim_walks_no_page_but_the_segment_it_empties",),
    ),
    M(
        "pool: close() deletes every key (a walk of the whole namespace)",
        "pools/page_pool.py",
        "        if self.joints or self.log is not None:\n            for key in list(self.entries):",
        "        if True:\n            for key in list(self.entries):",
        ("tests/pools/test_page_pool.py::test_close_walks_only_the_busy_pages",),
    ),
    M(
        "host: a tenant's new namespace takes a neighbour's segment though at its share",
        "pools/host_pool.py",
        "        owner_share, pool_share = self.owner_share(), (0.0 if first else self.pool_share(pool))\n        victims = []\n        room = max(owner_share, 1.0)  # growth stays within the share; a first segment: below it\n        if (held[pool.owner] < room) if first else (held[pool.owner] + 1 <= room):",
        "        owner_share, pool_share = (0.0, 0.0) if first else (self.owner_share(), self.pool_share(pool))\n        victims = []\n        room = max(owner_share, 1.0)\n        if first or held[pool.owner] + 1 <= room:",
        (
            "tests/pools/test_host_pool.py::test_new_namespaces_of_a_tenant_at_its_share_take_its_own_segments",
        ),
    ),
    M(
        "host: a pool's own segment going idle ends its reclaim skip",
        "pools/host_pool.py",
        "            if mine is not None:\n                self._no_reclaim[pool.name] = mine",
        "            pass",
        (
            "tests/pools/test_host_pool.py::test_a_reclaim_that_found_nothing_waits_for_a_segment_to_go_idle",
        ),
    ),
    M(
        "host: a reclaim that met write-back pages is skipped like a busy one",
        "pools/host_pool.py",
        "            if not got and not kept:",
        "            if not got:",
        ("tests/pools/test_host_pool.py::test_a_reclaim_that_met_write_back_pages_is_not_skipped",),
    ),
    M(
        "host: a first segment below a fractional share counted as at it",
        "pools/host_pool.py",
        "        if (held[pool.owner] < room) if first else",
        "        if (held[pool.owner] + 1 <= room) if first else",
        (
            "tests/pools/test_host_pool.py::test_a_first_segment_below_a_fractional_share_comes_from_the_owner_above_it",
        ),
    ),
    M(
        "pool: close() leaves the old index full for a look-up holding it",
        "pools/page_pool.py",
        "            self.ready.clear()  # in place",
        "            self.ready = {}  # in place",
        ("tests/pools/test_page_pool.py::test_close_walks_only_the_busy_pages",),
    ),
    M(
        "host: a reclaim that found nothing is tried again on every grow",
        "pools/host_pool.py",
        "                self._no_reclaim[pool.name] = RECLAIM_RETRY",
        "                pass",
        (
            "tests/pools/test_host_pool.py::test_a_reclaim_that_found_nothing_waits_for_a_segment_to_go_idle",
        ),
    ),
    M(
        "host: a segment going idle does not end the reclaim skip",
        "pools/host_pool.py",
        "            self._no_reclaim.clear()\n            if mine is not None:",
        "            if mine is None:",
        (
            "tests/pools/test_host_pool.py::test_a_reclaim_that_found_nothing_waits_for_a_segment_to_go_idle",
        ),
    ),
    M(
        "pool: run_in_any reads the last index only",
        "pools/page_pool.py",
        "            held = bytes(map(or_, held, map(index.__contains__, part)))",
        "            held = bytes(map(index.__contains__, part))",
        ("tests/pools/test_page_pool.py::test_run_in_any_is_the_walk_key_by_key",),
    ),
    M(
        "pool: pinned pages stay on the LRU list (eviction walks them)",
        "pools/page_pool.py",
        "            self._pinned += 1\n            self.lru.remove(e)\n",
        "            self._pinned += 1\n            self.lru.touch(e)\n",
        ("tests/pools/test_page_pool.py::test_eviction_never_walks_past_pinned_pages",),
    ),
    # -- write-through back-pressure --------------------------------------------------------
    M(
        "writer: no wait on a full write queue (--write-queue-pages)",
        "sidecar/tiers/writer.py",
        "        while self.full:\n            await self.changed()",
        "        while False:\n            await self.changed()",
        ("tests/sidecar/tiers/test_back_pressure.py",),
    ),
    M(
        "tiering: no cap of half a pool pinned for writing",
        "sidecar/tiering.py",
        "pool_full = busy and busy + n > max(1, pool.capacity_pages // 2)",
        "pool_full = False",
        ("tests/sidecar/tiers/test_back_pressure.py",),
    ),
    M(
        "write_through: a set's pages acknowledged without being queued",
        "sidecar/store.py",
        "queued = self.tiering.queue_committed(ns.identity, ns.pool, committed, credits)\n"
        "                futures.update(zip((e.key for e in committed), queued, strict=True))",
        "queued = self.tiering.release(ns.pool, credits) or []\n"
        "                futures.update(zip((e.key for e in committed), queued, strict=False))",
        ("tests/api/test_acknowledged.py",),
    ),
    # -- buffers: owner and pid-reuse guards, registration only on the engine socket -------
    M(
        "buffers: pid-reuse guard off",
        "sidecar/buffers.py",
        "return process_start(self.pid) == self.pid_start",
        "return process_start(self.pid) is not None",
        ("tests/sidecar/test_buffers_owner.py",),
    ),
    M(
        "buffers: any peer may use a buffer",
        "sidecar/buffers.py",
        "return self.owner_uid is None or (peer is not None and peer.uid == self.owner_uid)",
        "return True",
        ("tests/api/test_trust.py",),
    ),
    M(
        "buffers: shm registration accepted on TCP",
        "sidecar/buffers.py",
        "    if peer is None:\n        raise Forbidden(",
        "    if False:\n        raise Forbidden(",
        ("tests/api/test_trust.py::test_tcp_callers_cannot_register_memory",),
    ),
    # -- lent memory (issue 26, items 2, 4, 5, 10): off the loop, shares per uid ------------
    M(
        "buffers: lent fds closed on the loop",
        "sidecar/leases.py",
        "            close_later(self.lanes, lease.peer.uid, partial(os.close, lease.fd))",
        "            os.close(lease.fd)",
        ("tests/api/test_lending.py::test_lent_and_registered_fds_are_closed_off_the_loop",),
    ),
    M(
        "buffers: rejected fds closed on the loop",
        "sidecar/leases.py",
        "        for fd in rejected:\n            close_later(self.lanes, conn.uid, partial(os.close, fd))",
        "        for fd in rejected:\n            os.close(fd)",
        ("tests/api/test_lending.py::test_a_lingering_tcp_socket_is_closed_off_the_loop",),
    ),
    M(
        "buffers: any regular file may be lent",
        "sidecar/leases.py",
        "    if fs_type(fd) not in LENDABLE_FS:",
        "    if False:",
        ("tests/api/test_lending.py::test_only_memory_can_be_lent",),
    ),
    M(
        "buffers: idle fd connections never closed",
        "sidecar/leases.py",
        "        if not conn.leases:\n            conn.timer = self.loop.call_later(self.idle_timeout",
        "        if False:\n            conn.timer = self.loop.call_later(self.idle_timeout",
        ("tests/api/test_lending.py::test_idle_fd_connections_are_closed_and_lenders_stay",),
    ),
    M(
        "buffers: one uid may hold every fd connection",
        "sidecar/leases.py",
        " or self.per_uid[conn.uid] >= MAX_CONNECTIONS_PER_UID:",
        ":",
        ("tests/api/test_lending.py::test_fd_connections_leave_room_for_other_uids",),
    ),
    M(
        "buffers: one uid may hold every buffer",
        "sidecar/store.py",
        "            or (held >= MAX_BUFFERS_PER_UID and capped)\n",
        "            or False\n",
        ("tests/api/test_lending.py::test_buffers_leave_room_for_other_uids",),
    ),
    M(
        "buffers: mapped bytes of one uid unbounded",
        "sidecar/buffers.py",
        "            or self.mapped[owner] + mapped > self.max_mapped_per_uid\n        ):",
        "        ):",
        ("tests/api/test_lending.py::test_mapped_bytes_are_bounded_per_uid_and_in_all",),
    ),
    M(
        "buffers: the whole size mapped, not what the chunks cover",
        "sidecar/transports/shm.py",
        "self._map(fd, span or (0, size))",
        "self._map(fd, (0, size))",
        ("tests/api/test_lending.py::test_only_what_the_chunks_cover_is_mapped",),
    ),
    M(
        "buffers: a stuck copy does not mark its buffer bad",
        "sidecar/copier.py",
        '            buf.bad = f"a copy overran the {self.deadline:g} s copy deadline"\n',
        "",
        ("tests/sidecar/test_copier.py",),
    ),
    M(
        "buffers: one uid's copies may take every copy thread",
        "sidecar/lanes.py",
        "        if lane.running < self.per_owner:\n            self._start(lane, job)",
        "        if True:\n            self._start(lane, job)",
        ("tests/sidecar/test_copier.py::test_one_owners_stuck_copies_leave_threads_to_the_others",),
    ),
    M(
        "buffers: a stuck job gets no spare thread",
        "sidecar/lanes.py",
        "                not job.stuck\n                and job.started",
        "                False\n                and job.started",
        ("tests/sidecar/test_copier.py::test_a_stuck_job_gets_a_spare_thread",),
    ),
    # -- file tier recovery rebuilds the LRU by mtime ---------------------------------------
    M(
        "file tier: recovery ignores mtime order",
        "sidecar/tiers/file_tier.py",
        "order = sorted(range(len(names)), key=mtimes.__getitem__)",
        "order = sorted(range(len(names)), key=names.__getitem__)",
        ("tests/sidecar/tiers/test_file_tier.py::test_recovery_rebuilds_lru_by_mtime",),
    ),
    M(
        "file tier: a recovered page read stays as old as its mtime",
        "sidecar/tiers/file_tier.py",
        "            elif key in self.keys.get(identity, ()):",
        "            elif False:",
        ("tests/sidecar/tiers/test_recovery_index.py", "-k", "most_recent or one_lru"),
    ),
    M(
        "file tier: eviction takes a recovered page read since",
        "sidecar/tiers/file_tier.py",
        "            if size is not None and page not in self.lru:",
        "            if size is not None:",
        ("tests/sidecar/tiers/test_recovery_index.py", "-k", "most_recent or one_lru"),
    ),
    # -- SIGTERM drains ---------------------------------------------------------------------
    M(
        "server: SIGTERM exits without draining",
        "sidecar/server.py",
        "            self.force_exit = True  # a second signal: stop waiting for connections\n"
        "        self.should_exit = True",
        "            self.force_exit = True  # a second signal: stop waiting for connections\n"
        "        self.should_exit = self.force_exit = True",
        ("tests/sidecar/test_process.py::test_sigterm_completes_a_request_held_across_it",),
    ),
    M(
        "server: --shutdown-timeout ignored",
        "sidecar/server.py",
        "timeout_graceful_shutdown=config.shutdown_timeout,",
        "timeout_graceful_shutdown=None,",
        ("tests/sidecar/test_process.py::test_shutdown_timeout_bounds_the_drain",),
    ),
    # -- inline uploads in flight: an owner's part of the segments (issue 43, item 6) ------
    M(
        "uploads: trickling uploads in flight uncapped",
        "sidecar/ledger.py",
        "        if mine >= max(1, cap) or self.uploads()",
        "        if False and self.uploads()",
        ("tests/api/test_uploads.py",),
    ),
    M(
        "uploads: an owner's uploads in flight past its owner share",
        "sidecar/store.py",
        "        if not hold.take((r.offset,))[0]:",
        "        if not hold.take((r.offset,))[0] and False:",
        ("tests/api/test_uploads.py::test_an_uploader_holds_no_more_than_its_owner_share",),
    ),
    # -- pipelining: one request at a time, heads counted from their first byte (issue 43: 1)
    M(
        "pipelining: the next request parsed before the answer is out",
        "sidecar/server.py",
        "            if self._answer_due():\n                return self._hold(data, pos)",
        "            if False:\n                return self._hold(data, pos)",
        (
            "tests/api/test_pipelining.py::test_a_client_that_never_reads_has_one_request_parsed_ahead",
            "tests/api/test_pipelining.py::test_small_answers_nobody_reads_wait_here_one_at_a_time",
        ),
    ),
    M(
        "pipelining: an answer not all out lets the next request in",
        "sidecar/server.py",
        "        if not self.transport.get_write_buffer_size():",
        "        if True:",
        ("tests/api/test_pipelining.py::test_small_answers_nobody_reads_wait_here_one_at_a_time",),
    ),
    M(
        "pipelining: no bound on requests parsed ahead",
        "sidecar/server.py",
        "        if len(self.pipeline) >= PIPELINE_MAX:",
        "        if False:",
        (
            "tests/api/test_pipelining.py::test_requests_parsed_ahead_past_the_bound_cut_the_connection",
        ),
    ),
    M(
        "pipelining: a piece runs past the end of a request's head",
        "sidecar/server.py",
        "        return limit if i < 0 else i + len(HEAD_END)",
        "        return limit",
        ("tests/api/test_pipelining.py::test_pipelined_requests_are_answered_in_order",),
    ),
    M(
        "head budget: a pipelined head's first bytes not counted",
        "sidecar/server.py",
        "            self._head_left = self.settings.max_head - self._piece",
        "            pass",
        (
            "tests/api/test_pipelining.py::test_a_head_in_the_piece_that_ended_a_chunked_body_counts_from_its_first_byte",
        ),
    ),
    M(
        "head budget: blank lines keep a connection with no timer",
        "sidecar/server.py",
        "            self._arm(self._head_timeout())\n\n    def _feed(",
        "            pass\n\n    def _feed(",
        (
            "tests/api/test_pipelining.py::test_blank_lines_after_an_answer_do_not_keep_a_connection",
        ),
    ),
    # -- the hybrid hit rule (issue 12) -------------------------------------------------------
    M(
        "hybrid: min of each pool's best, not the intersection",
        "sidecar/hybrid.py",
        "    while low != hit:  # every endpoint in (low, hit] is one some pool cannot restore",
        "    while False:",
        ("tests/sidecar/test_hybrid_rule.py",),
    ),
    M(
        "hybrid: one pass over the pools (the hit lowered once)",
        "sidecar/hybrid.py",
        "        hit = low\n        low = min(",
        "        return low\n        low = min(",
        ("tests/sidecar/test_hybrid_rule.py::test_batch_exists_matches_brute_force",),
    ),
    M(
        "hybrid: the whole-prefix shortcut reads an all-pages pool's last page only",
        "sidecar/hybrid.py",
        "all(store.lookup.local_run(name, keys, top) >= top for name in alls)",
        "all(0 not in store.lookup.local_mask(name, keys[top - 1:top]) for name in alls)",
        ("tests/sidecar/test_hybrid_rule.py", "-k", "shortcut"),
    ),
    M(
        "hybrid: the whole-prefix shortcut skips the windows",
        "sidecar/hybrid.py",
        "if pool.policy != ALL_PAGES and 0 in store.lookup.local_mask(",
        "if False and 0 in store.lookup.local_mask(",
        ("tests/sidecar/test_hybrid_rule.py", "-k", "shortcut"),
    ),
    M(
        "joint: a page evicted from one pool stays in the joint",
        "pools/page_pool.py",
        "        del self.ready[e.key]\n        for joint in self.joints:\n            joint.removed(self, e.key)\n",
        "        del self.ready[e.key]\n",
        ("tests/pools/test_joint.py::test_a_page_evicted_from_one_pool_leaves_the_joint",),
    ),
    M(
        "joint: a page deleted from one pool stays in the joint",
        "pools/page_pool.py",
        "            del self.ready[key]\n            for joint in self.joints:\n"
        "                joint.removed(self, key)\n",
        "            del self.ready[key]\n",
        ("tests/sidecar/test_hybrid_rule.py", "-k", "joint"),
    ),
    M(
        "joint: a published page sets every pool's bit",
        "pools/joint.py",
        "self.masks[key] = chr(ord(self.masks.get(key, NONE)) | self.bit(pool))",
        "self.masks[key] = chr(ord(self.masks.get(key, NONE)) | (1 << len(self.pools)) - 1)",
        ("tests/pools/test_joint.py",),
    ),
    M(
        "joint: the build never adds the pages already there",
        "pools/joint.py",
        "                    if key in pool.ready:\n                        self.added(pool, key)",
        "                    if key in pool.ready:\n                        pass",
        ("tests/pools/test_joint.py", "tests/sidecar/test_joints.py"),
    ),
    M(
        "joint: the build adds a page gone before its step",
        "pools/joint.py",
        "                    if key in pool.ready:\n",
        "                    if True:\n",
        ("tests/pools/test_joint.py",),
    ),
    M(
        "joint: a walk trusts where its probes say the run ends",
        "pools/joint.py",
        "        end = held_by(read, need).find(0)",
        "        end = -1",
        ("tests/pools/test_joint.py",),
    ),
    M(
        "hybrid: the masks' answer reads an all-pages pool's last page only",
        "sidecar/hybrid.py",
        "        i = bits.find(0, 0, p)\n        return p if i < 0 else i\n",
        '        return p if bits[p - 1:p] != b"\\x00" else p - 1\n',
        ("tests/sidecar/test_hybrid_rule.py::test_batch_exists_matches_brute_force",),
    ),
    M(
        "hybrid: an all-pages pool assumed present past the joint's run",
        "sidecar/hybrid.py",
        "Presence(store, pool.namespace, keys, top, run=held)\n            if",
        "Presence(store, pool.namespace, keys, top, run=held + 1)\n            if",
        ("tests/sidecar/test_hybrid_rule.py", "tests/sidecar/test_lookup_tiers.py"),
    ),
    M(
        "hybrid: with a tier, the joint's run taken without the all-pages pools",
        "sidecar/hybrid.py",
        "        if pool.policy == ALL_PAGES:\n            need |= bit\n",
        "        if pool.policy == ALL_PAGES:\n            pass\n",
        ("tests/sidecar/test_lookup_tiers.py",),
    ),
    M(
        "hybrid: a trailing window taken as sent (2**64 pages)",
        "sidecar/hybrid.py",
        "policy, min(window, MAX_BATCH)))",
        "policy, window))",
        (
            "tests/sidecar/test_hybrid_rule.py::test_a_window_past_any_prefix_is_the_prefix_and_never_built",
        ),
    ),
    M(
        "hybrid: a plan kept for another store",
        "sidecar/hybrid.py",
        "        and kept[0] is extra\n        and kept[1] is store.dir\n",
        "        and kept[0] is extra\n",
        ("tests/sidecar/test_hybrid_rule.py::test_a_plan_is_kept_for_its_own_store_only",),
    ),
    M(
        "hybrid: only the first batch item validated",
        "sidecar/hybrid.py",
        "        ns, buf = store.check_move(item.namespace, item.keys, item.buffer_id, item.slots, peer)\n",
        "        ns, buf = store.check_move(item.namespace, item.keys, item.buffer_id, item.slots, peer) \\\n"
        "            if i == 0 else (ns, buf)\n",
        ("tests/api/test_hybrid.py::test_every_batch_item_is_validated_before_any_page_moves",),
    ),
    M(
        "hybrid: KV-first gating off",
        "sidecar/hybrid.py",
        "complete = all(all(v) for v in loaded.values())",
        "complete = True",
        ("tests/api/test_hybrid.py::test_batch_get_serves_extra_pools_only_after_every_kv_page",),
    ),
    # -- claims of the README / API.md (tests/api/test_claims.py) ----------------------------
    M(
        "readyz: ready before the tiers are recovered",
        "api/routes_health.py",
        "if ctx is None or not ctx.ready:",
        "if ctx is None:",
        ("tests/api/test_claims.py::test_readyz_is_503_until_tiers_are_recovered",),
    ),
    M(
        "prefetch: a failed promotion reported as done",
        "sidecar/store.py",
        'state["state"] = "failed"',
        'state["state"] = "done"',
        ("tests/api/test_claims.py::test_prefetch_ticket_reports_a_failed_promotion",),
    ),
    M(
        "prefetch: tickets never expire",
        "sidecar/store.py",
        "while len(self.tickets) > 4096:",
        "while len(self.tickets) > 1 << 30:",
        ("tests/api/test_claims.py::test_prefetch_tickets_expire_oldest_first",),
    ),
    M(
        "promote: no wait for the writer to free slots",
        "sidecar/tiering.py",
        "                if not later or left <= 0 or not (self.writing.get(pool.name) or self.backlogged()):",
        "                if True:",
        ("tests/sidecar/tiers/test_back_pressure.py",),
    ),
    M(
        "write-back: a peer's flush writes every tenant's dirty pages",
        "sidecar/store.py",
        "        for ns in list(self.dir.visible(who)):",
        "        for ns in list(self.namespaces.values()):",
        (
            "tests/sidecar/tiers/test_back_pressure.py::test_a_peers_flush_writes_its_own_namespaces_and_the_walk_yields",
        ),
    ),
    M(
        "write-back: the dirty walk holds the loop in one turn",
        "sidecar/tiering.py",
        "            if i:\n                await asyncio.sleep(0)",
        "            if False:\n                await asyncio.sleep(0)",
        (
            "tests/sidecar/tiers/test_back_pressure.py::test_a_peers_flush_writes_its_own_namespaces_and_the_walk_yields",
        ),
    ),
    M(
        "write-back: an eviction the full queue cannot take drops the page",
        "sidecar/tiering.py",
        "            return self.queue.try_submit(identity, e.key, page)\n",
        "            self.queue.try_submit(identity, e.key, page)\n            return True\n",
        (
            "tests/api/test_claims.py::test_write_back_keeps_pages_a_full_queue_cannot_take",
            "tests/api/test_durability.py::test_write_back_under_eviction_pressure_with_a_full_queue_loses_no_acknowledged_page",
        ),
    ),
    M(
        "deletes: queued writes of deleted keys not cancelled",
        "sidecar/tiers/writer.py",
        "                    job.cancelled = True\n",
        "                    pass\n",
        (
            "tests/api/test_durability.py::test_a_delete_during_a_held_write_sticks_across_flush_and_restart",
            "tests/api/test_durability.py::test_a_deleted_namespace_leaves_nothing_for_one_created_again",
        ),
    ),
    M(
        "pool: unpin leaves the pinned count",
        "pools/page_pool.py",
        "        if e.pins == 0:\n            self._pinned -= 1",
        "        if e.pins == 0:\n            pass",
        ("tests/pools/test_page_pool.py",),
    ),
    # -- KV events (issue 31, docs/kv-events.md) -----------------------------------------
    M(
        "copier: a finished move keeps its cycle with its jobs (every request's objects wait for the GC)",
        "sidecar/copier.py",
        "        self.jobs = []  # each job",
        "        pass  # each job",
        ("tests/sidecar/test_copier.py::test_a_finished_copy_leaves_no_cycle_for_the_gc",),
    ),
    M(
        "lanes: a call's ended job keeps its cycle with the answer",
        "sidecar/lanes.py",
        "                job.done = None  # the answer holds",
        "                pass  # the answer holds",
        ("tests/sidecar/test_copier.py::test_a_lane_call_that_ended_leaves_no_cycle_for_the_gc",),
    ),
    M(
        "events: every tier change made events in one flush",
        "sidecar/events.py",
        "        budget, skips = TIER_KEYS_A_FLUSH, 16 * TIER_KEYS_A_FLUSH\n",
        "        budget, skips = 1 << 60, 1 << 60\n",
        (
            "tests/api/test_kv_events.py::test_a_namespace_made_after_a_restart_announces_its_tier_pages",
        ),
    ),
    M(
        "events: entries no namespace hears of cost the others' flushes",
        "sidecar/events.py",
        "            else:\n                skips -= 1\n",
        "            else:\n                skips -= 1\n                budget -= len(keys)\n",
        ("tests/sidecar/test_events_tiers.py",),
    ),
    M(
        "events: a replaced announcement is made events too",
        "sidecar/events.py",
        "and number in (None, self.announced.get(identity)):",
        "and True:",
        ("tests/sidecar/test_events_tiers.py",),
    ),
    M(
        "events: an eviction not published",
        "sidecar/events.py",
        "                    for a, b in pieces(0, len(gone), keys_an_event(self.batch_bytes, 0))\n                )\n                continue",
        "                    for a, b in []\n                )\n                continue",
        ("tests/api/test_kv_events.py::test_a_subscriber_holds_what_the_sidecar_holds",),
    ),
    M(
        "events: a chain's parent left out",
        "sidecar/events.py",
        "None if parent is None else block_hash(parent, kf)",
        "None",
        ("tests/api/test_kv_events.py::test_a_stored_chain_carries_its_parent_and_tokens",),
    ),
    M(
        "events: a set's chain not cut where a key was stored before",
        "sidecar/events.py",
        "    if idx[-1] - idx[0] + 1 != len(idx):",
        "    if False:",
        ("tests/api/test_kv_events.py::test_a_set_with_a_key_present_before_stores_two_chains",),
    ),
    M(
        "events: token ids the packer refused are let through unchecked",
        "sidecar/events.py",
        "        if packed is None and not (\n            set(map(type, tokens)) <= _LIST",
        "        if False and not (\n            set(map(type, tokens)) <= _LIST",
        ("tests/api/test_kv_events.py::test_parents_and_tokens_are_checked",),
    ),
    M(
        "events: a set that stored some of its keys published as if it stored them all",
        "sidecar/store.py",
        "None if len(committed) == len(keys)",
        "None if True",
        ("tests/api/test_kv_events.py::test_a_set_with_a_key_present_before_stores_two_chains",),
    ),
    M(
        "events: a batch that cannot be encoded stalls every flush after it",
        "sidecar/events.py",
        "            return\n        if len(buf) > self.batch_bytes",
        "            raise\n        if len(buf) > self.batch_bytes",
        (
            "tests/api/test_kv_events.py::test_a_batch_that_cannot_be_encoded_is_counted_and_the_rest_go_on",
        ),
    ),
    M(
        "events: tier pages not announced when a namespace is made",
        "sidecar/events.py",
        "                self.tier_log.append(\n                    (ns.identity, tier.held_keys(ns.identity), medium_of(tier), True, number)\n                )",
        "                pass",
        (
            "tests/api/test_kv_events.py::test_a_namespace_made_after_a_restart_announces_its_tier_pages",
        ),
    ),
    M(
        "events: the replay ring keeps a batch a new one overwrote",
        "sidecar/replay_ring.py",
        "                len(self.index) >= self.keep or start <= self.index[0][2] < start + n\n",
        "                len(self.index) >= self.keep\n",
        ("tests/sidecar/test_replay_ring.py", "tests/sidecar/test_events_ring.py"),
    ),
    M(
        "events: the replay ring's wrap keeps the older lap",
        "sidecar/replay_ring.py",
        "                while self.index and self.index[0][2] >= start:",
        "                while False:",
        ("tests/sidecar/test_replay_ring.py",),
    ),
    M(
        "events: a batch's bytes not given back when it leaves the ring",
        "sidecar/replay_ring.py",
        "            self.bytes -= self.index.popleft()[3]",
        "            self.index.popleft()",
        ("tests/sidecar/test_replay_ring.py", "tests/sidecar/test_events_ring.py"),
    ),
    M(
        "events: a replay reads a batch overwritten meanwhile",
        "sidecar/replay_ring.py",
        "if self.map is None or not self.index or self.index[0][0] > seq:",
        "if self.map is None:",
        ("tests/sidecar/test_replay_ring.py",),
    ),
    M(
        "events: batches sent on every loop turn, not every gather",
        "sidecar/events.py",
        "            self.loop.call_later(self.gather, self.flush)",
        "            self.loop.call_soon(self.flush)",
        ("tests/api/test_kv_events.py::test_a_batch_gathers_the_loop_turns_of_its_gather",),
    ),
    M(
        "events: a subscriber that does not read holds batches up to vLLM's hwm",
        "sidecar/publisher.py",
        "            self.pub.set_hwm(self.hwm)",
        "            self.pub.set_hwm(100_000)",
        ("tests/sidecar/test_publisher.py",),
    ),
    M(
        "events: a replay queued to its client all at once",
        "sidecar/publisher.py",
        "                self.router.setsockopt(zmq.SNDHWM, limits.replay_hwm)",
        "                pass",
        ("tests/sidecar/test_publisher.py",),
    ),
    M(
        "events: a replay client that reads slowly holds the replay thread",
        "sidecar/publisher.py",
        "                return left - (time.monotonic() - t)",
        "                return left",
        ("tests/sidecar/test_publisher.py",),
    ),
    M(
        "events: ipc:// sockets made with the umask, not the engine socket's mode",
        "sidecar/publisher.py",
        '        if not (endpoint.startswith("ipc://") and self.unix is not None):',
        "        if True:",
        (
            "tests/api/test_kv_events_trust.py::test_event_sockets_are_the_sidecars_users_alone_by_default",
        ),
    ),
    # -- KV events and other users (issue 43: 3, 4, 7) ----------------------------------------
    M(
        "events: ipc:// sockets take the engine socket's mode and group",
        "sidecar/events.py",
        "bind_unix, mode=config.kv_events_mode, group=config.kv_events_group)",
        "bind_unix, mode=config.socket_mode, group=config.socket_group)",
        (
            "tests/api/test_kv_events_trust.py::test_event_sockets_are_the_sidecars_users_alone_by_default",
        ),
    ),
    M(
        "events: token ids published without the operator's opt-in",
        "sidecar/events.py",
        "        tokens = tokens if self.token_ids else None",
        "        pass",
        (
            "tests/api/test_kv_events_trust.py::test_token_ids_go_out_only_when_the_operator_opts_in",
        ),
    ),
    M(
        "events: token ids a key not capped at page_tokens",
        "sidecar/events.py",
        "max(map(len, meta[1])) > tokens_a_key(page_tokens):",
        "max(map(len, meta[1])) > 2**31:",
        (
            "tests/api/test_kv_events_trust.py::test_tokens_a_key_are_capped_at_the_namespaces_page_tokens",
        ),
    ),
    M(
        "events: a batch past batch bytes sent whole",
        "sidecar/events.py",
        "        if len(buf) > self.batch_bytes and len(events) > 1:",
        "        if False:",
        ("tests/api/test_kv_events_trust.py::test_a_large_set_goes_out_in_batches_of_batch_bytes",),
    ),
    M(
        "events: a set's chain made one event however large",
        "sidecar/events.py",
        "            for a, b in pieces(*run, step):",
        "            for a, b in [run]:",
        ("tests/api/test_kv_events_trust.py::test_a_large_set_goes_out_in_batches_of_batch_bytes",),
    ),
    M(
        "events: the PUB's queue bounded in batches, not bytes",
        "sidecar/events.py",
        "            Limits.of(config),",
        "            Limits(hwm=config.kv_events_hwm),",
        ("tests/api/test_kv_events_trust.py::test_the_pub_queue_is_bounded_in_bytes",),
    ),
    M(
        "events: identities of deleted namespaces kept",
        "sidecar/events.py",
        "        if not same:  # forgotten",
        "        if False:  # forgotten",
        ("tests/api/test_kv_events_trust.py::test_identities_of_deleted_namespaces_are_forgotten",),
    ),
    M(
        "events: a replay not paced",
        "sidecar/publisher.py",
        "            time.sleep(max(0.0, due - time.monotonic()))",
        "            pass",
        ("tests/sidecar/test_publisher.py",),
    ),
    # -- trust, round 5 (issue 52): roles, the ledger, loop turns ------------------------------
    M(
        "events: subscribers past the cap admitted",
        "sidecar/publisher.py",
        "        if len(self.open) <= self.cap:",
        "        if True:",
        (
            "tests/sidecar/test_publisher.py::test_subscribers_past_the_cap_are_refused_and_one_gets_in_when_a_place_is_free",
        ),
    ),
    M(
        "events: each subscriber's queue the whole budget",
        "sidecar/publisher.py",
        "        return min(self.hwm, each - (self.replay_hwm + 1) - 1)",
        "        return min(self.hwm, self.queue_bytes // self.batch_bytes)",
        (
            "tests/sidecar/test_publisher.py::test_subscribers_that_stop_at_different_times_hold_the_budget_at_most_together",
        ),
    ),
    M(
        "roles: the engine socket honours the operator's token",
        "sidecar/tenancy.py",
        "    if peer is not None:\n        return peer\n    if tenant",
        "    if peer is not None and not operator_tcp:\n        return peer\n    if tenant",
        (
            "tests/api/test_roles.py::test_engines_need_no_token_and_the_operators_gains_them_nothing",
        ),
    ),
    M(
        "roles: a tenant's token is the operator's",
        "api/guard.py",
        "            if role is not OPERATOR:\n                scope[TENANT_KEY] = role",
        "            if False:\n                scope[TENANT_KEY] = role",
        ("tests/api/test_roles.py::test_a_tenants_token_reaches_its_own_namespaces_only",),
    ),
    M(
        "ledger: holds past the owner's bound",
        "sidecar/ledger.py",
        "            if held > bound or (held == bound and not acct.held[seg]):",
        "            if False:",
        ("tests/sidecar/test_ledger.py", "tests/api/test_unread_answers.py"),
    ),
    M(
        "loop turns: an owner's newest pins end in one turn",
        "sidecar/controls/core.py",
        "            while order and n < CHUNK and len(",
        "            while order and len(",
        ("tests/api/test_loop_turns.py",),
    ),
    # -- operators' controls (issue 47, sidecar/controls/) -----------------------------------
    M(
        "controls: a pinned page left on the LRU (evicted)",
        "sidecar/controls/core.py",
        "        got = ns.pool.pin(key)\n",
        "        got = e\n",
        (
            "tests/api/test_controls.py::test_pinned_pages_outlive_eviction_pressure_and_unpin_lets_them_go",
        ),
    ),
    M(
        "controls: a pin past its owner's bound",
        "sidecar/controls/core.py",
        "        if len(held) + len(adds) > bound or not self.ledger.may_pin(",
        "        if False and not self.ledger.may_pin(",
        (
            "tests/api/test_controls.py::test_pins_are_bounded_per_owner_and_take_no_other_owners_share",
        ),
    ),
    M(
        "controls: the pin bound of one owner is the whole pool's half",
        "pools/host_pool.py",
        "        sharers = len(pools) + (owner not in pools)",
        "        sharers = 1",
        (
            "tests/api/test_controls.py::test_pins_are_bounded_per_owner_and_take_no_other_owners_share",
        ),
    ),
    M(
        "controls: a pin outlives its TTL",
        "sidecar/controls/core.py",
        "            if pin.expires > now:  # renewed: its one entry goes back, later",
        "            if True:",
        ("tests/api/test_controls.py::test_a_pin_ends_at_its_ttl",),
    ),
    M(
        "controls: evict by chain leaves the tiers' copies (back after a restart)",
        "sidecar/controls/core.py",
        "            d, f = await self.store.delete(ref, sel.keys[i : i + CHUNK])",
        "            d, f = sum(map(self.store.namespace(ref).pool.delete, sel.keys[i:i + CHUNK])), 0",
        (
            "tests/api/test_controls.py::test_evict_a_chain_from_a_key_on_from_every_tier_sticks_across_a_restart",
        ),
    ),
    M(
        "controls: a deleted page keeps its pin",
        "sidecar/store.py",
        "        self.controls.forget(ref, keys)",
        "        pass",
        (
            "tests/api/test_controls.py::test_evict_a_chain_from_a_key_on_from_every_tier_sticks_across_a_restart",
        ),
    ),
    M(
        "controls: a pinned page not written first (lost to a kill under write-back)",
        "sidecar/tiering.py",
        "        if self.writer is None:\n            return 0\n        n = 0\n",
        "        if True:\n            return 0\n        n = 0\n",
        (
            "tests/api/cli/test_controls_cli.py::test_pinned_pages_are_written_first_and_outlive_a_kill",
        ),
    ),
    M(
        "controls: a tenant controls a namespace it does not own",
        "sidecar/controls/core.py",
        "        if who is not OPERATOR and owner_of(who) != ns.owner:",
        "        if False:",
        (
            "tests/api/test_controls.py::test_a_tenant_cannot_pin_evict_or_warm_another_owners_namespace",
        ),
    ),
    M(
        "controls: a sharer's pins listing shows the owner's usage of every namespace",
        "sidecar/controls/core.py",
        "            **(self.usage(ns.owner) if who is OPERATOR or owner_of(who) == ns.owner else {}),",
        "            **self.usage(ns.owner),",
        (
            "tests/api/test_sharers_and_warm_jobs.py::test_a_sharer_listing_pins_learns_nothing_of_the_owners_other_namespaces",
        ),
    ),
    M(
        "controls: one owner's ended warm jobs push out another's",
        "sidecar/controls/warm.py",
        "        for j in mine[: max(own + 1 - WARM_KEPT_PER_OWNER, 0)]:",
        "        for j in mine[:0]:",
        (
            "tests/api/test_sharers_and_warm_jobs.py::test_a_tenants_warm_jobs_neither_push_out_anothers_nor_keep_their_keys",
        ),
    ),
    M(
        "controls: an ended warm job keeps its list of keys",
        "sidecar/controls/warm.py",
        "            job.keys = []  # 256 ended jobs",
        "            pass  # 256 ended jobs",
        (
            "tests/api/test_sharers_and_warm_jobs.py::test_a_tenants_warm_jobs_neither_push_out_anothers_nor_keep_their_keys",
        ),
    ),
    M(
        "pins kept: a pin restored into another owner's namespace of the same name",
        "sidecar/controls/pin_store.py",
        '    return f"{identity}\\n{ref}".encode()',
        "    return ref.encode()",
        (
            "tests/api/test_pins_kept.py::test_another_owner_making_the_same_name_after_a_restart_gets_no_pins",
        ),
    ),
    M(
        "pins kept: a TTL's end left in the record (back after a restart)",
        "sidecar/controls/core.py",
        "        self.expired += n\n        self._touch(ended)\n",
        "        self.expired += n\n",
        (
            "tests/api/test_pins_kept.py::test_an_unpin_a_ttls_end_and_a_delete_stick_across_a_restart",
        ),
    ),
    M(
        "pins kept: a get misses a page the restore is promoting",
        "sidecar/tiering.py",
        "        if others:\n            await asyncio.wait(others)\n",
        "",
        ("tests/api/test_pins_kept.py::test_a_get_during_a_restore_waits_for_the_page_not_a_miss",),
    ),
    M(
        "pins kept: a damaged record restored",
        "sidecar/controls/pin_store.py",
        "    if magic != MAGIC or digest != xxhash.xxh3_64_intdigest(scope(identity, ref) + body):",
        "    if magic != MAGIC:",
        ("tests/api/test_pins_kept.py::test_a_damaged_record_is_ignored_counted_and_removed",),
    ),
    # -- who shares with a group; anonymous TCP a tenant (issue 43: 2, 5) ------------------
    M(
        "tenancy: a name means a shared namespace its caller never joined",
        "sidecar/tenancy.py",
        "and (ns.spec == spec if spec is not None else peer.uid in ns.joined)",
        "and (spec is None or ns.spec == spec)",
        (
            "tests/api/test_sharers_and_warm_jobs.py::test_a_name_means_a_shared_namespace_only_to_whom_joined_it",
        ),
    ),
    M(
        "tenancy: share_gid taken from a non-member",
        "sidecar/tenancy.py",
        "    if share_gid is None or who is OPERATOR:\n        return",
        "    if True:\n        return",
        (
            "tests/api/test_share_groups_and_anonymous_tcp.py::test_share_gid_is_taken_only_from_a_member_of_the_group",
        ),
    ),
    M(
        "tenancy: anonymous TCP may share with any group",
        "sidecar/tenancy.py",
        "    if share_gid is None or who is OPERATOR:",
        "    if share_gid is None or not isinstance(who, Peer):",
        (
            "tests/api/test_share_groups_and_anonymous_tcp.py::test_share_gid_is_taken_only_from_a_member_of_the_group",
        ),
    ),
    M(
        "peer: supplementary groups asked with 4,096 bytes (CPython refuses)",
        "sidecar/peer.py",
        "PY_OPTLEN = 1024 ",
        "PY_OPTLEN = 4096 ",
        (
            "tests/api/test_share_groups_and_anonymous_tcp.py::test_supplementary_groups_are_read_from_the_kernel",
        ),
    ),
    M(
        "peer: past 256 groups none counted",
        "sidecar/peer.py",
        "        raw = _many_groups(sock.fileno())",
        "        return ()",
        (
            "tests/api/test_share_groups_and_anonymous_tcp.py::test_supplementary_groups_are_read_from_the_kernel[300]",
        ),
    ),
    M(
        "tenancy: a PUT joins the oldest shared namespace whatever its spec",
        "sidecar/tenancy.py",
        "                and (ns.spec == spec if spec is not None else peer.uid in ns.joined)",
        "                and (True if spec is not None else peer.uid in ns.joined)",
        (
            "tests/api/test_share_groups_and_anonymous_tcp.py::test_a_put_joins_the_shared_namespace_of_its_spec_not_the_oldest",
        ),
    ),
    M(
        "tenancy: anonymous TCP is the uncapped operator",
        "sidecar/tenancy.py",
        "    return None if who is OPERATOR else TCP_TENANT",
        "    return None",
        (
            "tests/api/test_share_groups_and_anonymous_tcp.py::test_anonymous_tcp_cannot_reserve_the_pool_over_a_tenants_pages",
        ),
    ),
    M(
        "views: TCP without a token sees every namespace's name",
        "api/deps.py",
        "    return who(ctx, scope)\n\n\ndef ready",
        "    from sidecar.tenancy import OPERATOR\n"
        "    return who(ctx, scope) if scope.get(PEER_KEY) else OPERATOR\n\n\ndef ready",
        (
            "tests/api/test_share_groups_and_anonymous_tcp.py::test_tcp_sees_only_its_own_names_unless_it_is_the_operator[None]",
        ),
    ),
    M(
        "views: samples name namespaces the asker does not reach",
        "sidecar/report.py",
        "names.get(ref, ref if who is OPERATOR else None)",
        "names.get(ref, ref)",
        (
            "tests/api/test_share_groups_and_anonymous_tcp.py::test_tcp_sees_only_its_own_names_unless_it_is_the_operator[None]",
        ),
    ),
    M(
        "views: every tenant's copy times shown to a peer",
        "sidecar/report.py",
        "    if who is OPERATOR:  # every tenant's copies",
        "    if True:  # every tenant's copies",
        ("tests/api/test_copy_times.py::test_copy_times_are_the_operators_to_see",),
    ),
    M(
        "copier: a move's copy time counted without its jobs' end",
        "sidecar/lanes.py",
        "            job.ended = time.monotonic()\n",
        "",
        ("tests/api/test_copy_times.py::test_a_moves_time_is_split_into_wait_copy_and_settle",),
    ),
    # -- never slower than recomputing (issue 44; api/engine/restore_cost.py) -------------
    M(
        "restore cost: a restore slower than its prefill still loads",
        "api/engine/restore_cost.py",
        "            if restore < tokens / rate:",
        "            if True:",
        ("tests/engines/adapters/test_restore_cost.py", "-k", "learns or round_trip or choose"),
    ),
    M(
        "restore cost: a tier judged slow is never tried again",
        "api/engine/restore_cost.py",
        "            if now - since >= wait:",
        "            if False:",
        ("tests/engines/adapters/test_restore_cost.py::test_a_tier_judged_slow_is_probed_again",),
    ),
    M(
        "restore cost: a tier still slow is probed as often",
        "api/engine/restore_cost.py",
        "                self.waits[slow] = min(2 * wait, 3600.0)",
        "                self.waits[slow] = wait",
        ("tests/engines/adapters/test_restore_cost.py::test_a_tier_judged_slow_is_probed_again",),
    ),
    M(
        "restore cost: a mixed load charged to the fast tier",
        "api/engine/restore_cost.py",
        "            slowest = max(moved, key=TIERS.index)",
        "            slowest = min(moved, key=TIERS.index)",
        (
            "tests/engines/adapters/test_restore_cost.py::test_a_mixed_load_charges_its_slowest_tier",
        ),
    ),
    M(
        "skipped: a sharer counts on another's namespace",
        "sidecar/store.py",
        '        if isinstance(who, Peer) and ns.owner != who.uid:\n            raise Forbidden(\n                f"namespace {ns.name!r} is shared with you; only its owner counts',
        '        if False:\n            raise Forbidden(\n                f"namespace {ns.name!r} is shared with you; only its owner counts',
        (
            "tests/engines/adapters/test_restore_cost.py::test_a_tenant_counts_only_on_its_own_namespaces",
        ),
    ),
    M(
        "skipped: a count without bound",
        "api/routes_pages.py",
        "    if type(value) is not int or not 0 <= value <= limit:",
        "    if type(value) is not int or value < 0:",
        ("tests/engines/adapters/test_restore_cost.py::test_skipped_restores_are_counted",),
    ),
    M(
        "exists where: the host run counts tier pages",
        "api/fastpath.py",
        "        host = min(ctx.store.namespace(name).pool.prefix(keys), local) if local else 0",
        "        host = local",
        (
            "tests/engines/adapters/test_restore_cost.py::test_exists_where_tells_host_pool_from_file_tier",
        ),
    ),
    M(
        "tenancy: anonymous TCP's buffers uncapped",
        "sidecar/store.py",
        "            capped = ns.owner is not None",
        "            capped = False",
        (
            "tests/api/test_share_groups_and_anonymous_tcp.py::test_anonymous_tcp_buffers_count_against_one_tenants_share",
        ),
    ),
    M(
        "tenancy: anonymous TCP has the operator's tier identity",
        "sidecar/tenancy.py",
        '        return owner\n    return f"uid:{owner}"',
        '        return "operator"\n    return f"uid:{owner}"',
        (
            "tests/api/test_share_groups_and_anonymous_tcp.py::test_anonymous_tcp_and_the_operator_never_share_tier_identity",
        ),
    ),
    # -- the GPU check and the linker's device path (issue 46) ----------------------------
    M(
        "gpu: a linker pool whose page views are copies registered by CUDA IPC",
        "api/engine/sglang_linker_cuda.py",
        'return "a buffer\'s pages are not a view of it"',
        "pass",
        ("tests/engines/adapters/test_linker_cuda.py::test_what_cannot_go_direct_says_why",),
    ),
    M(
        "gpu: a wheel for another Python carried to the GPU machine",
        "scripts/gpu_wheels.py",
        'if py_ok and t.abi in ("none", "abi3", "cp312") and plat_ok:',
        "if plat_ok:",
        ("tests/test_gpu_wheels.py", "-k", "installable or only_wheels"),
    ),
    M(
        "gpu: an IPC handle's last close runs outside the registry lock",
        "sidecar/transports/cuda_ipc.py",
        "with self._lock:\n            entry = self._open.get((pid, handle))\n            assert",
        "with threading.Lock():\n            entry = self._open.get((pid, handle))\n            assert",
        (
            "tests/sidecar/test_cuda_registry.py::test_an_open_during_the_last_close_gets_a_live_mapping",
        ),
    ),
    M(
        "gpu: a mapping's close syncs the device on the caller's thread",
        "sidecar/transports/cuda_ipc.py",
        "            self.cuda.release_later(self.pid, handles)",
        "            for h in reversed(handles):\n                self.cuda.release(self.pid, h)",
        (
            "tests/sidecar/test_cuda_registry.py::test_a_mapping_closes_its_handles_off_the_calling_thread",
        ),
    ),
    M(
        "gpu: a failed device copy answered as the caller's error",
        "sidecar/transports/cuda_ipc.py",
        '"cudaMemcpyAsync", CopyFailed\n',
        '"cudaMemcpyAsync"\n',
        ("tests/sidecar/test_cuda_registry.py::test_copy_errors_fail_the_pages_not_the_request",),
    ),
    # -- one driver call a plan, adjacent slots (issue 54) ----------------------------------
    M(
        "gpu: a plan's runs one driver call each where the driver has cuMemcpyBatchAsync",
        "sidecar/transports/cuda_ipc.py",
        "        for abi in BATCH_ABIS:\n",
        "        for abi in ():\n",
        ("tests/sidecar/test_cuda_copies.py::test_a_plan_goes_to_the_device_as_one_batch_call",),
    ),
    M(
        "gpu: a batch's sources read in any order, not stream order",
        "sidecar/transports/cuda_ipc.py",
        "ORDER_STREAM = 1  #",
        "ORDER_STREAM = 3  #",
        (
            "tests/sidecar/test_cuda_copies.py::test_adjacent_pages_are_one_run_and_both_directions_read_in_stream_order",
        ),
    ),
    M(
        "gpu: every plan of a job waits for the stream",
        "sidecar/transports/base.py",
        'run_plans = getattr(mapping, "run_plans", None)',
        "run_plans = None",
        (
            "tests/sidecar/test_cuda_copies.py::test_a_long_request_is_one_call_a_plan_and_one_stream_sync",
        ),
    ),
    M(
        "gpu: a failed submission leaves its copies running on the slots",
        "sidecar/transports/cuda_ipc.py",
        "        finally:\n            self.wait(dev)\n",
        "        except BaseException:\n            raise\n        self.wait(dev)\n",
        (
            "tests/sidecar/test_cuda_copies.py::test_a_failed_submission_is_copy_failed_and_the_stream_is_still_waited_for",
        ),
    ),
    M(
        "pool: given-back slots handed out as a stack (a request's pages descend)",
        "pools/page_pool.py",
        "RUN_WALK = 256  #",
        "RUN_WALK = 0  #",
        (
            "tests/pools/test_adjacent_slots.py::test_pages_deleted_in_order_or_reversed_come_back_in_address_order",
        ),
    ),
    M(
        "pool: a request's next page not taken from the slot after its last",
        "pools/page_pool.py",
        "        if slot in self.free:\n",
        "        if False:\n",
        (
            "tests/pools/test_adjacent_slots.py::test_a_row_of_given_back_slots_is_read_with_one_run_start",
        ),
    ),
    M(
        "copies: runs per page not counted in /v1/stats",
        "sidecar/copier.py",
        "            t.runs += self.runs\n",
        "",
        ("tests/sidecar/test_copy_runs.py::test_copies_count_pages_and_runs",),
    ),
    M(
        "gpu: a failing step of scripts/gpu_check.sh passes the check",
        "scripts/gpu_check.sh",
        '[ "$RC" -ne 0 ] && FAILED=1',
        "true",
        ("tests/test_gpu_check.py::test_failing_steps_fail_the_check_and_every_step_still_runs",),
    ),
    # -- bench-serve (issue 44): conversations and the manifest's flags --------------------
    M(
        "bench-serve: turn k's prompt leaves out turn k-1's answer",
        "loadtest/serving/lib.py",
        "return (prev_prompt + prev_answer + new) if k else new",
        "return (prev_prompt + new) if k else new",
        ("tests/loadtest/test_bench_serve.py::test_turns_grow_by_the_traces_new_tokens",),
    ),
    M(
        "bench-serve: vllm serve drops the manifest's flags",
        "loadtest/serving/lib.py",
        "        args.append(a)\n    return args + list(extra)",
        "    return args + list(extra)",
        ("tests/loadtest/test_bench_serve.py::test_serve_args_keep_the_manifests_flags",),
    ),
    M(
        "bench-serve: the warm-up counted",
        "loadtest/serving/lib.py",
        'kept = [r for r in recs if r["n"] >= warmup]',
        "kept = list(recs)",
        (
            "tests/loadtest/test_bench_serve.py::test_level_summary_drops_the_warm_up_and_counts_errors",
        ),
    ),
    M(
        "bench-serve: a user's warm-up taken from its measured share",
        "loadtest/serving/lib.py",
        "return warmup + -(-requests // users)",
        "return max(warmup, -(-requests // users))",
        (
            "tests/loadtest/test_bench_serve.py::test_every_arm_plays_the_same_requests_on_the_same_engines",
        ),
    ),
    # -- the 3FS tier at cluster scale (issue 55) -----------------------------------------
    M(
        "3fs: a torn or damaged slot served",
        "sidecar/tiers/hf3fs_slots.py",
        "    return digest is not None and xxhash.xxh3_64_intdigest(dst) == digest",
        "    return digest is not None",
        (
            "tests/sidecar/tiers/test_hf3fs_tier.py"
            "::test_a_damaged_or_truncated_slot_file_is_a_miss",
        ),
    ),
    M(
        "3fs: a rescan after start instead of reading the logs",
        "sidecar/tiers/hf3fs_tier.py",
        "        if self._ready.is_set():\n            return self.poll_once()",
        "        if False:\n            return self.poll_once()",
        (
            "tests/sidecar/tiers/test_hf3fs_tier.py"
            "::test_no_rescan_after_start_only_the_logs_are_read",
        ),
    ),
    # -- the store off the engine's critical path (issue 53) ------------------------------
    M(
        "store: a step waits for the sidecar to give staging slots back",
        "api/engine/vllm_worker.py",
        "slots = self.slots.try_take(len(keys))",
        "slots = self.slots.take(len(keys))",
        (
            "tests/engines/adapters/test_vllm_connector_parts.py"
            "::test_a_step_never_waits_for_the_sidecar_to_free_staging",
        ),
    ),
    M(
        "store: the tier writers compete with engines at full priority",
        "sidecar/tiers/writer.py",
        "    def _work(self) -> None:\n        yield_cpu()\n",
        "    def _work(self) -> None:\n",
        (
            "tests/sidecar/tiers/test_back_pressure.py"
            "::test_the_writer_threads_yield_the_cpu_to_engines",
        ),
    ),
    M(
        "store: a late exists answer always costs the request a whole step",
        "api/engine/vllm_scheduler.py",
        "where = look.future.result(timeout=self.wait_s(look.tokens - num_computed))",
        "where = look.future.result(timeout=self.lookup_wait)",
        (
            "tests/engines/adapters/test_vllm_connector_parts.py"
            "::test_a_late_answer_within_the_share_is_a_hit_not_a_skipped_step",
        ),
    ),
    M(
        "store: the wait for a late answer is a share of the mean step only",
        "api/engine/vllm_scheduler.py",
        "step = max(self.step_s or STEP_PRIOR_S, tokens * self.token_s)",
        "step = self.step_s or STEP_PRIOR_S",
        (
            "tests/engines/adapters/test_vllm_connector_parts.py"
            "::test_the_wait_covers_the_step_a_long_prompt_would_join",
        ),
    ),
    M(
        "store: an answer asked on arrival is never asked again",
        "api/engine/vllm_scheduler.py",
        "look = self._fresh(request, look)",
        "look = look",
        (
            "tests/engines/adapters/test_vllm_connector_parts.py"
            "::test_an_old_partial_answer_is_asked_again_when_the_request_is_matched",
        ),
    ),
]


def tree_files(root: str) -> list[str]:
    """Tracked and untracked-but-not-ignored files (what a fresh clone plus local work has)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    return [p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(root, p))]


# Compiled extensions built in place by the install (ignored by git) that the copy takes
# along: the CUDA transport hands its plans to the driver only through sidecar/_kvcopy.c,
# so its mutants' tests need it. The others stay out: the copy is what git lists.
BUILT = ("sidecar/_kvcopy",)


def copy_tree(root: str, dest: str) -> None:
    for rel in tree_files(root):
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(root, rel), target)
    for stem in BUILT:
        for path in glob.glob(os.path.join(root, glob.escape(stem) + ".*.so")):
            shutil.copy2(path, os.path.join(dest, os.path.relpath(path, root)))


def run_tests(tree: str, tests: tuple[str, ...], timeout: float) -> int:
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "--no-header",
        "-o",
        "addopts=",
        *tests,
    ]
    try:
        return subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, timeout=timeout
        ).returncode
    except subprocess.TimeoutExpired:
        return 1  # a mutant that hangs its tests is caught (the timeout is far above a pass)


def check(mutant: Mutant, tree: str, timeout: float) -> str:
    path = os.path.join(tree, mutant.path)
    with open(path) as f:
        text = f.read()
    n = text.count(mutant.original)
    if n != 1:
        return f"ERROR (snippet found {n} times)"
    try:
        with open(path, "w") as f:
            f.write(text.replace(mutant.original, mutant.replacement))
        rc = run_tests(tree, mutant.tests, timeout)
    finally:
        with open(path, "w") as f:
            f.write(text)
    return {0: "SURVIVED", 1: "caught", 4: "SURVIVED (no test file)", 5: "SURVIVED (no test)"}.get(
        rc, f"ERROR (pytest exit {rc})"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only mutants whose name contains this")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per mutant's tests")
    ap.add_argument(
        "--whole-files",
        action="store_true",
        help="run each listed test's whole file (a survey, e.g. before new tests)",
    )
    ap.add_argument(
        "--tests-from",
        metavar="REV",
        help="survey: the tests/ of git revision REV (whole files; a file it lacks: no test)",
    )
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up the copy when stopped
    chosen = [m for m in MUTANTS if args.k in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name}  [{m.path}]  -> {' '.join(m.tests)}")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="kv-mutants-") as tree:
        copy_tree(ROOT, tree)
        if args.tests_from:
            shutil.rmtree(os.path.join(tree, "tests"))
            archive = subprocess.run(
                ["git", "archive", args.tests_from, "tests"],
                cwd=ROOT,
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
            args.whole_files = True
        for m in chosen:
            if args.whole_files:
                m = replace(
                    m, tests=tuple(sorted({t.split("::")[0] for t in m.tests if ".py" in t}))
                )
            t0 = time.perf_counter()
            verdict = check(m, tree, args.timeout)
            results.append(verdict)
            print(f"{verdict:<10} {time.perf_counter() - t0:6.1f}s  {m.name}", flush=True)
    bad = sum(r != "caught" for r in results)
    print(f"{len(results) - bad}/{len(results)} mutants caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
