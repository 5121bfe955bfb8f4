"""KV events (`--kv-events ENDPOINT`): what the sidecar holds, for cache-aware routers.

    page pools (commit, evict, delete;  --log--+
      a set's stores encoded at its commit)    |
    tiers (written, evicted, deleted; any      |   Events (the loop): one batch a topic
      thread, in the order they happen)  ------+-> every `gather` s (20 ms), encoded here
    namespaces (made, dropped)           ------+        |
                                                         v  (on the loop; refused: counted)
                                          PUB  [topic, seq (8-byte big-endian), payload]
                        replay thread:    ROUTER [id, b"", seq] -> each kept batch from seq
                                          on, then [id, b"", b"", -1, b""]

The wire is vLLM's (`vllm.distributed.kv_events`): a payload is a msgpack EventBatch
`[ts, [event, ...]]` of `BlockStored(block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name)`, `BlockRemoved(block_hashes, medium)` and
`AllBlocksCleared()`. Two encodings of an event, as consumers parse them:

    map    {"type": "BlockStored", "block_hashes": [...], ...}   (vLLM's tagged structs)
    array  ["BlockStored", [...], parent, [tokens], 16, None, "CPU_PINNED", None]

Media: CPU_PINNED (the host pool), DISK (the file tier), EXTERNAL (3FS, Mooncake).
Topic: `<prefix>@<namespace>`, one per namespace (its pages, every medium); a dropped
namespace is `AllBlocksCleared` on its topic. Block hashes are the namespace's keys in the
form its engine's router knows (`key_format`): `vllm` the bytes of the hex key (vLLM's
block hash), `sglang` SGLang's int64 of the key (`hash_str_to_int64`), else the key.
A store carries `parent_block_hash` when the set that stored it gave one, and its
`token_ids` (a prompt: every subscriber reads them) only with `token_ids` on
(`--kv-events-token-ids`; else an empty list). A batch is at most `batch_bytes`: a chain's
event takes half of it at most (`keys_an_event`), and a topic's events past it go in
several batches.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import operator
import time
from collections.abc import Iterator
from typing import Any

from sidecar.errors import BadRequest
from sidecar.peer import bind_unix
from sidecar.publisher import Limits, Publisher

try:  # C (sidecar/_evpack.c), built at install where a compiler is: the same bytes, sooner
    from sidecar import _evpack
except ImportError:  # pragma: no cover - a build without a compiler
    # the stub (_evpack.pyi) types the module; without it every use checks for None
    _evpack = None  # type: ignore[assignment]

log = logging.getLogger("kv_sidecar.events")
MEDIUM_HOST, MEDIUM_DISK, MEDIUM_EXTERNAL = "CPU_PINNED", "DISK", "EXTERNAL"
FORMATS = ("map", "array")
_LIST, _INT = {list}, {int}
CHAIN = "chain"  # a pool log entry's `present` for a set's commits (Events.stored_chain)
TIER_KEYS_A_FLUSH = 4096  # tier pages made events in one flush (the rest wait for the next)
TOKENS = "'tokens' must hold one list of token ids (integers) per key"
MAX_TOKENS_A_KEY = 4096  # token ids of one key at most (a namespace's page_tokens, if less)
KEY_BYTES = 131  # a block hash's msgpack at most (a 128-character key as a string)
EVENT_BYTES = 512  # an event's msgpack beside its arrays, at most (its parent's hash too)
BATCH_BYTES = 256 * 2**10  # bytes of one batch at most (`--kv-events-batch-bytes`)


def block_hash(key: str, key_format: str) -> Any:
    """A page key as the routers of its engine name the block (a key not in that form,
    e.g. an extra pool's suffixed key, goes as it is)."""
    try:
        if key_format == "vllm":
            return bytes.fromhex(key)
        if key_format == "sglang":
            value = int(key[:16], 16)
            return value - 2**64 if value >= 2**63 else value
    except ValueError:
        pass
    return key


def hashes(keys: list, key_format: str) -> list:
    """`block_hash` of each key (vLLM's hex keys in one pass when they all are)."""
    if key_format == "vllm":
        try:
            return list(map(bytes.fromhex, keys))
        except ValueError:
            pass
    return [block_hash(k, key_format) for k in keys]


def hash_array(keys: list, a: int, b: int, key_format: str, raw: Any) -> Any:
    """The block hashes of `keys[a:b]` for an event: vLLM's hex keys as their msgpack
    array, encoded already (`raw(bytes)`, spliced by msgspec), where the packer is built;
    else `hashes`, the same bytes once encoded."""
    if key_format == "vllm" and _evpack is not None:
        out = _evpack.hex_array(keys, a, b)
        if out is not None:
            return raw(out)
    return hashes(keys[a:b], key_format)


def token_array(tokens: list, a: int, b: int, raw: Any) -> Any:
    """The token ids of `tokens[a:b]` (one list a page) as one flat list for an event:
    packed already where the packer is built, else the list (C extends)."""
    if _evpack is not None:
        out = _evpack.flat_ints(tokens, a, b)
        if out is not None:
            return raw(out)
    return functools.reduce(operator.iadd, tokens[a:b], [])


def encode_event(kind: str, fields: dict, fmt: str) -> Any:
    """One event as `fmt` lays it out (the module docstring)."""
    if fmt == "map":
        return {"type": kind, **fields}
    return [kind, *fields.values()]


def stored_event(
    hashes: Any, parent: Any, tokens: Any, block_size: int, medium: str, fmt: str
) -> Any:
    return encode_event(
        "BlockStored",
        {
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        },
        fmt,
    )


def removed_event(hashes: Any, medium: str, fmt: str) -> Any:
    return encode_event("BlockRemoved", {"block_hashes": hashes, "medium": medium}, fmt)


def runs_of(idx: list) -> list[tuple[int, int]]:
    """The runs of consecutive positions in `idx` (ascending, not empty), as (a, b): a..b-1."""
    runs, start = [], 0
    if idx[-1] - idx[0] + 1 != len(idx):  # a gap: keys present before, or refused
        for j in range(1, len(idx)):
            if idx[j] != idx[j - 1] + 1:
                runs.append((idx[start], idx[j - 1] + 1))
                start = j
    runs.append((idx[start], idx[-1] + 1))
    return runs


def set_meta(body: dict) -> tuple | None:
    """A set's optional `parent` (the key before its first) and `tokens` (token ids, one
    list per key) for KV events (docs/kv-events.md), as (parent, tokens, packed); None
    when it gives neither. `packed`: the tokens as one event's array, where the packer is
    built: it checks their types as it packs them, in one C pass while they are in
    cache, and a set that stores all its keys sends these bytes (else None)."""
    parent, tokens = body.get("parent"), body.get("tokens")
    if parent is None and tokens is None:
        return None
    if parent is not None and not (isinstance(parent, str) and 0 < len(parent) <= 128):
        raise BadRequest("'parent' must be the key before the first one")
    packed, keys = None, body.get("keys")
    if tokens is not None:
        if not (isinstance(tokens, list) and isinstance(keys, list) and len(tokens) == len(keys)):
            raise BadRequest(TOKENS)
        packed = _evpack.flat_ints(tokens, 0, len(tokens)) if _evpack is not None else None
        if packed is None and not (
            set(map(type, tokens)) <= _LIST  # C loops, no bools
            and set(map(type, itertools.chain.from_iterable(tokens))) <= _INT
        ):
            raise BadRequest(TOKENS)
    return parent, tokens, packed


def tokens_a_key(page_tokens: int) -> int:
    """Token ids one key may carry: the namespace's `page_tokens` (a page holds no more),
    MAX_TOKENS_A_KEY where it gives none or more."""
    return min(page_tokens, MAX_TOKENS_A_KEY) if page_tokens > 0 else MAX_TOKENS_A_KEY


def check_tokens(meta: tuple | None, page_tokens: int) -> None:
    """A set's `tokens` (`set_meta`) against its namespace: at most `tokens_a_key` a key
    (what an event holds is bounded in bytes, docs/kv-events.md, Limits)."""
    if meta is not None and meta[1] and max(map(len, meta[1])) > tokens_a_key(page_tokens):
        raise BadRequest(
            f"'tokens' may hold {tokens_a_key(page_tokens)} token ids a key at most "
            f"(the namespace's page_tokens)"
        )


def keys_an_event(batch_bytes: int, tokens: int) -> int:
    """Keys one event may name so that it takes half a batch at most (`tokens` ids a key)."""
    return max(1, (batch_bytes // 2 - EVENT_BYTES) // (KEY_BYTES + 9 * tokens))


def pieces(a: int, b: int, step: int) -> list[tuple[int, int]]:
    """a..b-1 in runs of `step` at most, as (a, b)."""
    return [(i, min(i + step, b)) for i in range(a, b, step)]


class Events:
    """Events of one sidecar, collected on the event loop and flushed every `gather` seconds
    (a batch costs ZMQ some 45 us of CPU, its I/O thread's wake-up and send included, so
    batches of 20 ms rather than of each loop turn).

    Pools append `(True, key)` or a gone key to their `log` (pools/page_pool.py); the
    store calls `stored_chain` with a set's commits, parent and tokens (one entry in the
    same log), and `watch` and `dropped_namespace` as namespaces come and go; tiers call
    `tier_changed` from any thread."""

    def __init__(self, publisher: Publisher, topic: str, fmt: str, loop, gather: float):
        self.publisher, self.prefix, self.fmt, self.loop = publisher, topic, fmt, loop
        self.gather = gather
        self.by_pool: dict = {}  # pool -> its namespace
        self.dirty: set = set()  # pools with a log to flush
        self.pending: dict[bytes, list] = {}  # topic -> this turn's events, in order
        # (identity, keys, medium, present, announcement number or None); `_tier_at`: how
        # far into the first entry's keys the flushes got
        self.tier_log: collections.deque = collections.deque()
        self._tier_at = 0
        self.announced: dict[str, int] = {}  # identity -> its latest announcement's number
        self.identities: dict[str, list] = {}  # identity -> its live namespaces
        # (both hold live identities only: an identity goes with its last namespace, and
        # announcement numbers never repeat, so a queued one of a gone identity stays stale)
        self.numbers = itertools.count(1)
        self.token_ids = False  # token ids published (`--kv-events-token-ids`)
        self.batch_bytes = BATCH_BYTES
        self.dropped_bytes = 0  # bytes of the batches counted in `dropped`
        self.scheduled = False
        self.dropped = 0  # batches ZMQ refused
        self.published = 0
        import msgspec  # the `events` extra

        self.encoder = msgspec.msgpack.Encoder()
        self.encode, self.raw = self.encoder.encode, msgspec.Raw
        self.buf = bytearray()  # each batch encoded here (no allocation a batch)

    # -- what the store tells -------------------------------------------------------
    def topic(self, ns) -> bytes:
        return f"{self.prefix}@{ns.name}".encode()

    def watch(self, ns, tiers: list) -> None:
        """A namespace was made: follow its pool; the first of its identity announces
        the pages its tiers hold already."""
        self.by_pool[ns.pool] = ns
        ns.pool.log, ns.pool.on_log = [], self._logged
        same = self.identities.setdefault(ns.identity, [])
        same.append(ns)
        if len(same) == 1:  # (an announcement still queued for the identity is replaced)
            number = self.announced[ns.identity] = next(self.numbers)
            for tier in tiers:
                self.tier_log.append(
                    (ns.identity, tier.held_keys(ns.identity), medium_of(tier), True, number)
                )
            self._schedule()

    def dropped_namespace(self, ns) -> None:
        """Everything of `ns` goes (its pool closed, its tier pages being dropped); what
        its pool logged since the last flush is published first, in order."""
        self._drain_pool(ns.pool)
        ns.pool.log = None
        self.by_pool.pop(ns.pool, None)
        self.dirty.discard(ns.pool)
        same = self.identities.get(ns.identity, [])
        if ns in same:
            same.remove(ns)
        if not same:  # forgotten: what its tiers still log is skipped (no live namespace)
            self.identities.pop(ns.identity, None)
            self.announced.pop(ns.identity, None)
        self._add(self.topic(ns), encode_event("AllBlocksCleared", {}, self.fmt))

    def stored_chain(self, pool, keys: list, idx: list | None, meta: tuple) -> None:
        """A set's commits as one log entry (the pool logged none of them): `idx`, the
        positions in `keys` committed, ascending, at least one (None: all of them; the store
        calls only when a page was committed); `meta`, the set's `set_meta`. Its events are
        built now, their arrays packed while the set's keys and tokens are in cache (the
        flush encodes them into its batch; without the packer, encoded now: a set's lists
        kept for a gather cost more, docs/kv-events.md, Cost)."""
        ns = self.by_pool.get(pool)
        if ns is None or pool.log is None:
            return
        if not pool.log:
            self._logged(pool)
        chains = list(self._chains(ns, keys, idx, *meta))
        if _evpack is None:
            chains = [self.raw(self.encode(e)) for e in chains]
        pool.log.append((CHAIN, chains))

    def tier_changed(self, identity: str, keys: list, medium: str, present: bool) -> None:
        """From any thread, in the order the tier changed its index."""
        self.tier_log.append((identity, keys, medium, present, None))
        self.loop.call_soon_threadsafe(self._schedule)

    # -- collecting -----------------------------------------------------------------
    def _logged(self, pool) -> None:
        self.dirty.add(pool)
        self._schedule()

    def _schedule(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_later(self.gather, self.flush)

    def _add(self, topic: bytes, event: Any) -> None:
        self.pending.setdefault(topic, []).append(event)
        self._schedule()

    def flush(self) -> None:
        """The events gathered since the last flush, one batch a topic, to ZMQ."""
        self.scheduled = False
        for pool in self.dirty:
            self._drain_pool(pool)
        self.dirty.clear()
        self._drain_tiers()
        if not self.pending:
            return
        ts = time.time()
        for topic, events in self.pending.items():
            self._send(topic, ts, events)
        self.pending.clear()

    def _send(self, topic: bytes, ts: float, events: list) -> None:
        """One batch of `events`, or, past `batch_bytes`, the two halves' batches in
        order (an event takes half a batch at most: `keys_an_event`)."""
        buf = self.buf
        try:  # into the same buffer each time: ZMQ and the ring copy it before the next
            self.encoder.encode_into([ts, events], buf)
        except (TypeError, ValueError, OverflowError):
            # no event is known to do this; one that did costs its topic's batch
            # (counted), not the other topics' batches nor every flush after it
            log.exception("kv events: a batch of %r could not be encoded: dropped", topic)
            self.dropped += 1
            return
        if len(buf) > self.batch_bytes and len(events) > 1:
            half = len(events) // 2
            self._send(topic, ts, events[:half])
            self._send(topic, ts, events[half:])
        elif self.publisher.send(topic, buf):
            self.published += 1
        else:
            self.dropped += 1
            self.dropped_bytes += len(buf)

    def _drain_pool(self, pool) -> None:
        ns, entries = self.by_pool.get(pool), pool.log
        if ns is None or not entries:
            return
        pool.log = []
        topic, kf = self.topic(ns), ns.spec.key_format
        out = self.pending.setdefault(topic, [])
        for kind, run in itertools.groupby(entries, type):  # grouped in C
            if kind is str:  # keys evicted or deleted, in a row
                gone = list(run)
                out.extend(
                    removed_event(hash_array(gone, a, b, kf, self.raw), MEDIUM_HOST, self.fmt)
                    for a, b in pieces(0, len(gone), keys_an_event(self.batch_bytes, 0))
                )
                continue
            for present, key in run:
                if present is CHAIN:  # a set's stores, built at its commit
                    out.extend(key)
                else:  # (True, key): stored without a set's parent and tokens
                    out.append(self._stored(ns, hashes([key], kf), None, []))

    def _chains(
        self,
        ns,
        keys: list,
        idx: list | None,
        parent: str | None,
        tokens: list | None,
        packed: bytes | None,
    ) -> Iterator[Any]:
        """One BlockStored for each run of consecutive positions in `idx` (None: all of
        `keys`, with the tokens `packed` already where they are), split into pieces of
        half a batch at most: its parent is the key before it (the set's `parent` before
        the first), its tokens theirs where token ids are published (else none)."""
        kf, raw = ns.spec.key_format, self.raw
        tokens = tokens if self.token_ids else None
        step = keys_an_event(self.batch_bytes, tokens_a_key(ns.spec.page_tokens) if tokens else 0)
        whole = idx is None and packed is not None and tokens is not None and len(keys) <= step
        for run in [(0, len(keys))] if idx is None else runs_of(idx):
            for a, b in pieces(*run, step):
                up = keys[a - 1] if a else parent
                if whole:  # the whole set in one event: its ids packed at parse
                    assert packed is not None, "whole without packed ids"
                    toks = raw(packed)
                else:
                    toks = token_array(tokens, a, b, raw) if tokens else []
                yield self._stored(ns, hash_array(keys, a, b, kf, raw), up, toks)

    def _stored(self, ns, block_hashes: Any, parent: str | None, tokens: Any) -> Any:
        """The host pool's BlockStored of `block_hashes` (made already), after key `parent`."""
        kf = ns.spec.key_format
        return stored_event(
            block_hashes,
            None if parent is None else block_hash(parent, kf),
            tokens,
            ns.spec.page_tokens,
            MEDIUM_HOST,
            self.fmt,
        )

    def _drain_tiers(self) -> None:
        """Tier changes in order, TIER_KEYS_A_FLUSH keys at most: the first namespace of an
        identity announces every page its tiers hold (a million pages of a file tier: one
        event each), so the rest waits for the next gather instead of holding the loop.
        Entries no namespace would hear of (its identity has none now, or a newer
        announcement replaces it) are skipped, 16 times as many a flush: a dropped
        namespace's pages or a create-delete loop do not hold back other tenants' events."""
        budget, skips = TIER_KEYS_A_FLUSH, 16 * TIER_KEYS_A_FLUSH
        while self.tier_log and budget > 0 and skips > 0:
            identity, keys, medium, present, number = self.tier_log[0]
            if self.identities.get(identity) and number in (None, self.announced.get(identity)):
                part = keys[self._tier_at : self._tier_at + budget]
                self._tier_at += len(part)
                budget -= max(len(part), 1)
                self._drain_tier(identity, part, medium, present)
                if self._tier_at < len(keys):
                    break
            else:
                skips -= 1
            self.tier_log.popleft()
            self._tier_at = 0
        if self.tier_log:
            self._schedule()

    def _drain_tier(self, identity: str, keys: list, medium: str, present: bool) -> None:
        for ns in self.identities.get(identity, ()):
            topic, kf = self.topic(ns), ns.spec.key_format
            if present:  # a tier knows no parents: one event a page
                for key in keys:
                    self._add(
                        topic,
                        stored_event(
                            [block_hash(key, kf)], None, [], ns.spec.page_tokens, medium, self.fmt
                        ),
                    )
            else:
                for a, b in pieces(0, len(keys), keys_an_event(self.batch_bytes, 0)):
                    self._add(topic, removed_event(hashes(keys[a:b], kf), medium, self.fmt))


def medium_of(tier) -> str:
    """The local file tier is DISK; a tier the cluster shares (3FS, Mooncake) EXTERNAL."""
    return MEDIUM_DISK if tier.name == "file" else MEDIUM_EXTERNAL


def start(config, loop, tiers: list) -> Events:
    """The publisher (its thread) and the collector for `config`, tiers wired to it."""
    import socket

    replay = config.kv_events_replay or _next_port(config.kv_events)
    unix = functools.partial(bind_unix, mode=config.kv_events_mode, group=config.kv_events_group)
    events = Events(
        Publisher(
            config.kv_events,
            replay,
            config.kv_events_buffer,
            config.kv_events_buffer_bytes,
            Limits.of(config),
            unix,
        ),
        config.kv_events_topic or f"kv-sidecar@{socket.gethostname()}",
        config.kv_events_format,
        loop,
        config.kv_events_gather,
    )
    events.token_ids, events.batch_bytes = config.kv_events_token_ids, config.kv_events_batch_bytes
    for tier in tiers:
        medium = medium_of(tier)
        tier.listener = lambda ident, keys, present, m=medium: events.tier_changed(
            ident, keys, m, present
        )
    log.info(
        "kv events on %s (replay %s), %s encoding, token ids %s",
        config.kv_events,
        replay,
        config.kv_events_format,
        "on" if events.token_ids else "off",
    )
    for endpoint in (config.kv_events, replay):
        if endpoint and not endpoint.startswith("ipc://"):
            log.warning(open_endpoint(endpoint, events.token_ids))
    return events


def open_endpoint(endpoint: str, token_ids: bool) -> str:
    """What a TCP endpoint shows, and to whom (logged at start)."""
    host = endpoint.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    who = (
        "every user on this node"
        if host in ("127.0.0.1", "localhost", "::1")
        else "every user on this node and every host that routes to it"
    )
    what = (
        "namespace names, block hashes and token ids (the prompts)"
        if token_ids
        else "namespace names and block hashes"
    )
    return (
        f"kv events: {endpoint} is open to {who}: they read every tenant's {what}; bind "
        f"ipc:// paths with --kv-events-group to name who may (docs/security.md, KV events)"
    )


def _next_port(endpoint: str) -> str | None:
    """tcp://host:port -> tcp://host:port+1; None for any other endpoint."""
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit() and port != "0":
        return f"{head}:{int(port) + 1}"
    return None
