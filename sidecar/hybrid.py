"""Several pools at once (hybrid models): the batch hit rule and batch moves.

An endpoint p (pages [0, p) restored) is legal for a pool when, under its policy,
all_pages: pages [0, p) are present; trailing_pages, window w: pages [max(0, p-w), p) are.
hit = the greatest p <= kv legal for EVERY extra pool (the intersection, not the minimum
of each pool's best: a trailing pool's legal endpoints have holes).

    keys:         k0  k1  k2  k3  k4  k5
    kv:            x   x   x   x   x   .    kv = 5 (longest present prefix)
    endpoint p:  0   1   2   3   4   5
    mamba (w=1):   .   x   .   x   .        legal {0, 2, 4}        own best 4
    swa   (w=2):   x   x   x   .   x        legal {0, 1, 2, 3}     own best 3
    indexer:       x   x   x   x   x        legal {0, .., 5}       own best 5
    hit = max({0, 2, 4} & {0, 1, 2, 3} & {0, .., 5}) = 2; min of the bests would say 3,
    where Mamba has no state.

Each pool clears its illegal endpoints in one byte per endpoint, one slice per run of
missing pages (linear in keys x pools). Extra pools keep a page under the KV key of the
same position.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Any, Generic, TypeVar

import orjson

from pools.joint import held_by, table
from sidecar.errors import BadRequest, PayloadTooLarge
from sidecar.events import check_tokens, set_meta
from sidecar.joints import joint_bits
from sidecar.keys import MAX_BATCH
from sidecar.namespace import Ref
from sidecar.peer import Peer
from sidecar.spec import check_name
from sidecar.store import Store
from sidecar.tenancy import OPERATOR, Caller
from sidecar.transports.base import MAX_RUNS

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
POLICIES = (ALL_PAGES, TRAILING_PAGES)
_EXTRA_FIELDS = frozenset({"namespace", "policy", "window"})
MIN_CHUNK = 32  # pages a Presence looks up at least at a time (one local_mask call each)
N = TypeVar("N", bound=str)  # an extra pool's namespace: its name as asked, or its Ref


@dataclass(frozen=True, slots=True)
class ExtraPool(Generic[N]):
    namespace: N
    policy: str = ALL_PAGES
    window: int = 1


def legal_endpoints(mask: bytes, top: int, window: int) -> bytearray:
    """ok[p] = 1 for each endpoint p in 0..top this pool can restore; `mask[i]` is 1 when
    page i is present (it covers >= top pages). all_pages is a window of `top` or more."""
    ok = bytearray(b"\x01") * (top + 1)
    miss = mask.find(0, 0, top)
    while miss >= 0:
        back = mask.find(1, miss, top)  # misses at [miss, back) make (miss, back-1+w] illegal
        back = top if back < 0 else back
        hi = min(top, back - 1 + window)
        ok[miss + 1 : hi + 1] = bytes(hi - miss)
        if hi == top:
            break
        miss = mask.find(0, back, top)
    return ok


def parse_extra(raw: Any) -> tuple[ExtraPool[str], ...]:
    """The extra pools of a batch/exists. An engine sends the same few lists again and
    again: each distinct one (by its JSON bytes) is checked once, then looked up (the
    same tuple each time, which `resolve` keeps its plans by)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > 64:
        raise BadRequest("'extra' must be a list of at most 64 {namespace, policy, window}")
    seen = orjson.dumps(raw)
    pools = _PARSED.get(seen)
    if pools is None:
        pools = _parse_extra(raw)
        if len(_PARSED) >= PARSED_MAX:
            _PARSED.clear()
        _PARSED[seen] = pools
    return pools


PARSED_MAX = 256
_PARSED: dict[bytes, tuple[ExtraPool[str], ...]] = {}


def _parse_extra(raw: list) -> tuple[ExtraPool[str], ...]:
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("namespace"), str):
            raise BadRequest(f"extra[{i}] must be an object with a 'namespace' string")
        if not _EXTRA_FIELDS.issuperset(item):
            raise BadRequest(f"extra[{i}] has unknown fields {sorted(set(item) - _EXTRA_FIELDS)}")
        policy = item.get("policy", ALL_PAGES)
        if policy not in POLICIES:
            raise BadRequest(f"extra[{i}].policy must be one of {list(POLICIES)}")
        window = item.get("window", 1)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise BadRequest(f"extra[{i}].window must be an integer >= 1")
        # a window past any prefix (MAX_BATCH keys) means the prefix, [0, p): the same
        # answers, and never a window-sized bytes to build
        out.append(ExtraPool(check_name(item["namespace"]), policy, min(window, MAX_BATCH)))
    # a pool named twice alike asks the same again: once (the answer is by name anyway)
    return tuple(dict.fromkeys(out))


class Presence:
    """One pool's pages over the KV prefix `keys[:top]`, looked up from the top down and
    only as far as asked, in doubling chunks of at least MIN_CHUNK pages: a trailing
    pool's hit usually needs its last window only. `bits[i - lo]` is 1 when page i
    (lo <= i < top) is present. Look-ups are synchronous (host pool, local tiers); with a
    remote tier, `bits` comes whole from one awaited look-up instead. `run`: pages
    [0, run) are known present (an all-pages pool's part of the joint's run). `floor`:
    where the first look-up may as well reach down to (a partial hit's answer lies near
    the all-pages pools' run: one look-up instead of a doubling series)."""

    __slots__ = ("store", "ref", "keys", "top", "lo", "bits", "run", "run_ends", "floor")

    def __init__(
        self,
        store: Store,
        ref: Ref,
        keys: list[str],
        top: int,
        bits: bytes | None = None,
        run: int = 0,
        floor: int | None = None,
    ):
        self.store, self.ref, self.keys, self.top = store, ref, keys, top
        self.lo, self.bits = (top, b"") if bits is None else (0, bits)
        self.run, self.run_ends = run, False
        self.floor = top if floor is None else floor

    def _reach(self, i: int) -> None:
        if i < self.lo:
            lo = max(0, min(i, 2 * self.lo - self.top, self.lo - MIN_CHUNK, self.floor))
            self.floor = self.top
            self.bits = self.store.lookup.local_mask(self.ref, self.keys[lo : self.lo]) + self.bits
            self.lo = lo

    def last_window(self, p: int, window: int) -> int:
        """The greatest endpoint q <= p whose `window` pages [q - window, q) are present
        (pages [0, q) below a window): the last run of `window` ones in `bits` that ends
        by p, looked for in C, `bits` reaching lower only while none is found."""
        while True:
            self._reach(max(0, p - window))
            if self.lo == 0:
                return window_end(self.bits, p, window)
            i = self.bits.rfind(b"\x01" * window, 0, p - self.lo)
            if i >= 0:
                return self.lo + i + window
            p = min(p, self.lo + window - 1)  # a window ending later lies in [lo, p)
            self._reach(self.lo - 1)

    def first_missing(self, p: int) -> int:
        """The least i < p whose page is missing, p when none is. Below what `bits` holds,
        a walk from page 0 that stops at the first miss (remembered in `run`: pages
        [0, run) are present, and page run is missing when `run_ends`)."""
        if self.lo > 0:
            below = min(p, self.lo)
            if self.run < below and not self.run_ends:
                self.run = self.store.lookup.local_run(self.ref, self.keys, below, self.run)
                self.run_ends = self.run < below
            if self.run < below or p <= self.lo:
                return min(self.run, p)
        i = self.bits.find(0, 0, p - self.lo)
        return p if i < 0 else i + self.lo

    def all(self) -> bytes:
        self._reach(0)
        return self.bits


def cap(pool: ExtraPool, seen: Presence, p: int) -> int:
    """The greatest endpoint <= p this pool can restore."""
    if pool.policy == ALL_PAGES:
        return seen.first_missing(p)
    return seen.last_window(p, pool.window)


def window_end(bits: bytes, p: int, window: int) -> int:
    """Over the bits of pages [0, ..): the greatest endpoint q <= p whose `window` pages
    are present (pages [0, q) when q < window)."""
    i = bits.rfind(b"\x01" * window, 0, p)
    if i >= 0:
        return i + window
    gap = bits.find(0, 0, p)
    return min(p, window - 1, p if gap < 0 else gap)


def bits_cap(pool: ExtraPool, bits: bytes, p: int) -> int:
    """`cap` over the bits of pages [0, ..)."""
    if pool.policy == ALL_PAGES:
        i = bits.find(0, 0, p)
        return p if i < 0 else i
    return window_end(bits, p, pool.window)


async def batch_exists(
    store: Store,
    keys: Any,
    kv: Any,
    extra: Sequence[ExtraPool[str]],
    restorable: bool = False,
    who: Caller = OPERATOR,
) -> dict[str, Any]:
    """{"hit", "kv", "pools"} (and with `restorable`, every endpoint > 0 legal for all).
    Names are those `who` knows (sidecar/tenancy.py): a pool it reaches under no such
    name holds nothing. The keys are validated once, by the KV look-up; every pool reads
    that prefix only. Without a remote tier, the KV pool and every extra pool are walked
    once together, through their joint (`sidecar.joints`), made after the first ask and
    used once built: with the host pool alone, the rule then runs on its masks in C."""
    if not isinstance(kv, str):
        raise BadRequest("'kv' must name the KV namespace")
    plan = resolve(store, kv, extra, who)
    out = await _batch_exists(store, keys, plan, restorable)
    out["pools"] = dict(zip(plan.asked, out["pools"], strict=True))
    return out


@dataclass(frozen=True, slots=True)
class Plan:
    """What the names of a batch/exists mean to its caller: refs (sidecar/tenancy.py),
    and the bit of each in their joint (`sidecar.joints.joint_bits`): the KV pool's, then
    the extra pools' in order."""

    kv: Ref
    extra: tuple[ExtraPool[Ref], ...]
    asked: tuple[str, ...]
    names: list[Ref]  # the refs of `extra`
    bits: tuple[int, ...]
    tables: tuple[bytes, ...]  # each extra pool's `pools.joint.table`


def resolve(store: Store, kv: str, extra: Sequence[ExtraPool[str]], who: Caller) -> Plan:
    """The Plan of `kv` and `extra` for `who`. An engine asks with the same names again
    and again: a plan is kept by the parsed list (`parse_extra` hands out one tuple per
    distinct list) until a namespace comes or goes (`Directory.version`, of this store's
    own Directory)."""
    key = (id(extra), kv, who)
    kept = _PLANS.get(key)
    if (
        kept is not None
        and kept[0] is extra
        and kept[1] is store.dir
        and kept[2] == store.dir.version
    ):
        return kept[3]
    ref = store.resolve(kv, who)
    refs = tuple(
        ExtraPool(store.dir.ref(pool.namespace, who), pool.policy, pool.window) for pool in extra
    )
    names = [pool.namespace for pool in refs]
    bits = joint_bits((ref, *names))
    plan = Plan(
        ref, refs, tuple(pool.namespace for pool in extra), names, bits, tuple(map(table, bits[1:]))
    )
    if len(_PLANS) >= PARSED_MAX:
        _PLANS.clear()
    _PLANS[key] = (
        extra,
        store.dir,
        store.dir.version,
        plan,
    )  # `extra` kept: its id names no other list
    return plan


_PLANS: dict[tuple, tuple] = {}  # (id(extra), kv, who) -> (extra, its Directory, version, Plan)


async def _batch_exists(store: Store, keys: Any, plan: Plan, restorable: bool) -> dict[str, Any]:
    kv, extra, remote = plan.kv, plan.extra, store.tiering.remote
    names = [] if remote else plan.names
    joint = store.lookup.joint(kv, names) if names else None
    if joint is not None and joint.built:  # one walk for the KV pool and every extra pool
        top, more, masks = store.lookup.joint_walk(kv, keys, joint, plan.bits[0])
        if not store.tiering.enabled:  # the host pool is all there is: the masks say it all
            return rule_on_masks((masks, plan.tables), extra, top, restorable)
        held = run_of(masks, plan.bits, extra)
    else:
        (top, more), held = (
            store.lookup.local_prefix(kv, keys),
            0,
        )  # validates the keys past the prefix
        if names and joint is None:  # the request passed its checks: the next ones walk a joint
            store.lookup.make_joint(kv, names)
    if more:
        top = await store.lookup.remote_prefix(kv, keys, top)
    if remote and extra:  # one remote look-up per pool, all at once
        found = await asyncio.gather(
            *(store.lookup.mask(pool.namespace, keys[:top]) for pool in extra)
        )
        seen = [
            Presence(store, pool.namespace, keys, top, m)
            for pool, m in zip(extra, found, strict=True)
        ]
    elif not restorable and restores_top(store, extra, keys, top, held):
        return {"hit": top, "kv": top, "pools": [top] * len(extra)}
    else:  # the joint's run is in each all-pages pool; the hit is at most that run
        seen = [
            Presence(store, pool.namespace, keys, top, run=held)
            if pool.policy == ALL_PAGES
            else Presence(
                store,
                pool.namespace,
                keys,
                top,
                floor=held - pool.window - MIN_CHUNK if held else None,
            )
            for pool in extra
        ]
    return hit_rule(extra, seen, top, restorable)


def run_of(masks: bytes, bits: tuple[int, ...], extra: Sequence[ExtraPool]) -> int:
    """The leading run of `masks` that the KV pool and every all-pages pool hold (`bits`:
    the KV pool's, then each extra pool's)."""
    need = bits[0]
    for bit, pool in zip(bits[1:], extra, strict=True):
        if pool.policy == ALL_PAGES:
            need |= bit
    end = held_by(masks, need).find(0)
    return len(masks) if end < 0 else end


def rule_on_masks(
    walked: tuple[bytes, Sequence[bytes]], extra: Sequence[ExtraPool], top: int, restorable: bool
) -> dict[str, Any]:
    """The answer from a joint's masks of the whole KV prefix (`walked`: the masks, each
    extra pool's `pools.joint.table`): each pool's pages read in C, no look-up left."""
    masks, tables = walked
    held = [masks.translate(t) for t in tables]
    own = [bits_cap(pool, h, top) for pool, h in zip(extra, held, strict=True)]
    if min(own, default=top) == top and not restorable:  # every pool restores it all
        return {"hit": top, "kv": top, "pools": own}
    out = {"hit": common_hit(extra, (bits_cap, held), own, top), "kv": top, "pools": own}
    if restorable:
        out["restorable"] = common_endpoints(extra, held, top)
    return out


def restores_top(
    store: Store, extra: Sequence[ExtraPool[Ref]], keys: list[str], top: int, held: int = 0
) -> bool:
    """Whether every pool restores the whole KV prefix (then it is the hit, and each
    pool's own best): the usual answer, one local look-up per pool, the windows first.
    `held`: a run every all-pages pool is known to hold (their joint's); short of the
    prefix, those pools are asked first, from there (the likelier miss, one look-up)."""
    alls = [pool.namespace for pool in extra if pool.policy == ALL_PAGES]
    short = 0 < held < top
    if short and any(store.lookup.local_run(name, keys, top, held) < top for name in alls):
        return False
    for pool in extra:
        if pool.policy != ALL_PAGES and 0 in store.lookup.local_mask(
            pool.namespace, keys[max(0, top - pool.window) : top]
        ):
            return False
    return (
        short or held >= top or all(store.lookup.local_run(name, keys, top) >= top for name in alls)
    )


def hit_rule(
    extra: Sequence[ExtraPool], seen: list[Presence], top: int, restorable: bool
) -> dict[str, Any]:
    """The answer, each pool's pages as its Presence finds them."""
    own = [cap(pool, s, top) for pool, s in zip(extra, seen, strict=True)]
    out = {"hit": common_hit(extra, (cap, seen), own, top), "kv": top, "pools": own}
    if restorable:
        out["restorable"] = common_endpoints(extra, [s.all() for s in seen], top)
    return out


def common_hit(
    extra: Sequence[ExtraPool], caps: tuple[Callable, list], own: list[int], top: int
) -> int:
    """The greatest endpoint <= min(own, top) that every pool restores, from each pool's
    own best (`own`) and its pages: `caps` is (`cap` or `bits_cap`, each pool's pages),
    the greatest endpoint <= p a pool restores being `cap(pool, pages, p)`."""
    cap_of, pages = caps
    hit = min(own, default=top)  # a pool whose own best it is restores it
    low = min(
        [
            o if o == hit else cap_of(pool, seen, hit)
            for pool, seen, o in zip(extra, pages, own, strict=True)
        ],
        default=hit,
    )
    while low != hit:  # every endpoint in (low, hit] is one some pool cannot restore
        hit = low
        low = min(
            [cap_of(pool, seen, hit) for pool, seen in zip(extra, pages, strict=True)], default=hit
        )
    return hit


def common_endpoints(extra: Sequence[ExtraPool], bits: list[bytes], top: int) -> list[int]:
    """Every endpoint in 1..top that every pool can restore, ascending (`bits`: each
    pool's pages [0, top))."""
    common = int.from_bytes(bytearray(b"\x01") * (top + 1), "little")
    for pool, b in zip(extra, bits, strict=True):
        window = top if pool.policy == ALL_PAGES else pool.window
        common &= int.from_bytes(legal_endpoints(b, top, window), "little")
    return list(compress(range(1, top + 1), common.to_bytes(top + 1, "little")[1:]))


@dataclass(frozen=True, slots=True)
class Item:
    namespace: Ref  # the ref of the name the item was asked by (`parse_items`)
    keys: Any  # checked by `Store.check_move` as the item is parsed
    buffer_id: Any
    slots: Any
    meta: tuple | None = None  # KV events: `events.set_meta`


def parse_items(
    store: Store, raw: Any, peer: Peer | None = None, who: Caller = OPERATOR
) -> list[Item]:
    """Validate every item (namespace, keys, buffer, slots) before any page moves; each
    item's `namespace` becomes the ref its name means to `who`."""
    if not isinstance(raw, list) or not raw or len(raw) > 64:
        raise BadRequest("'items' must be a non-empty list of at most 64 items")
    items, seen, runs = [], set(), 0
    for i, it in enumerate(raw):
        if not isinstance(it, dict):
            raise BadRequest(f"items[{i}] must be an object")
        name = it.get("namespace")
        if not isinstance(name, str) or name in seen:
            raise BadRequest(f"items[{i}].namespace must be a namespace named once per request")
        seen.add(name)
        item = Item(
            store.resolve(name, who),
            it.get("keys"),
            it.get("buffer_id"),
            it.get("slots"),
            set_meta(it),
        )
        ns, buf = store.check_move(item.namespace, item.keys, item.buffer_id, item.slots, peer)
        check_tokens(item.meta, ns.spec.page_tokens)
        runs += len(item.keys) * len(buf.chunks)
        items.append(item)
    if runs > MAX_RUNS:  # the copy plans of one request, all items together
        raise PayloadTooLarge(f"the items plan {runs} copies in all; at most {MAX_RUNS} a request")
    return items


async def batch_set(
    store: Store, raw_items: Any, peer: Peer | None = None, who: Caller = OPERATOR
) -> dict[str, list[bool]]:
    """Each pool stores what it can: one pool out of room does not fail the others."""
    items = parse_items(store, raw_items, peer, who)
    results = await asyncio.gather(
        *(
            store.set(i.namespace, i.keys, i.buffer_id, i.slots, peer=peer, meta=i.meta)
            for i in items
        )
    )
    return {name: r for name, r in zip(_names(raw_items), results, strict=True)}


def _names(raw_items: list) -> list[str]:
    """The names the items were asked by (each resolved to a ref by `parse_items`)."""
    return [it["namespace"] for it in raw_items]


async def batch_get(
    store: Store,
    raw_items: Any,
    kv: str | None = None,
    peer: Peer | None = None,
    who: Caller = OPERATOR,
) -> dict[str, list[bool]]:
    """KV items first; the other items only when every KV page loaded, else all false."""
    items = parse_items(store, raw_items, peer, who)
    if kv is not None and kv not in _names(raw_items):
        raise BadRequest(f"'kv' names {kv!r}, which is not one of the items")
    kv = None if kv is None else items[_names(raw_items).index(kv)].namespace
    anchors = [
        i
        for i in items
        if (i.namespace == kv if kv is not None else store.namespace(i.namespace).spec.pool == "kv")
    ]
    loaded: dict[str, list[bool]] = {}
    for i in anchors:
        loaded[i.namespace] = await store.get(i.namespace, i.keys, i.buffer_id, i.slots, peer)
    complete = all(all(v) for v in loaded.values())
    rest = [i for i in items if i not in anchors]
    if complete:
        results = await asyncio.gather(
            *(store.get(i.namespace, i.keys, i.buffer_id, i.slots, peer) for i in rest)
        )
    else:
        results = [[False] * len(i.keys) for i in rest]
    loaded.update({i.namespace: r for i, r in zip(rest, results, strict=True)})
    return {name: loaded[i.namespace] for name, i in zip(_names(raw_items), items, strict=True)}
