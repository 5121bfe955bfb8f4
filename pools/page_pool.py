"""One namespace's pages: fixed-size slots in arena segments, the key index, LRU and pins.

A slot is a byte offset into the arena. Its page lives at [offset, offset + page_bytes).

    segment k (segment_size bytes, owned by this pool)
    +--------+--------+--------+-----+--------+------+
    | slot 0 | slot 1 | slot 2 | ... | slot m | tail |   m = segment_size // page_bytes - 1
    +--------+--------+--------+-----+--------+------+   tail < page_bytes, unused

Free slots cost nothing until used: a segment's slots are handed out in address order
from its `fresh` run (next, end), and only a slot given back (abort, eviction, delete)
joins the `free` slots. So the pool's memory grows with the pages it holds, never with
the slots its segments could hold (a pool of 512-byte pages in 64 MiB segments would
otherwise list 131,072 ints a segment up front).

Adjacent slots: a reserve takes the given-back slot after the one handed out last when
it is free, so a request's pages (reserved one after another) land in adjacent slots and
its copies merge into long runs (`build_plan`, sidecar/transports/base.py). Else a new run
starts at the lowest free slot in the row below the last one given back (an earlier
request's pages, evicted or deleted in order), else at the next never-used slot.

An entry is RESERVED (being written, invisible to readers) or READY (published). Writers
go `reserve -> commit | abort`; readers `pin -> unpin`. Only READY entries with no pins
are evicted, and only those `on_evict` lets go (write-back keeps a page it cannot queue
for writing yet; eviction then takes the next one). A deleted entry that is still pinned or
being written becomes "doomed": gone from the index at once, its slot freed when the last pin or the writer lets go.

The LRU list holds only what eviction may take: READY entries with no pins (as vLLM's
free block queue holds only blocks with no references). A first pin takes a page off the
list; the last unpin puts it back as the most recent. So eviction never walks past
pinned pages: with a namespace's every page pinned (copies, writes to a slow tier) a
reserve answers "no room" at once instead of walking the whole pool for each key.

    READY, pins 0 (on the LRU) --pin--> READY, pins > 0 (off) --last unpin--> MRU end

Busy slots (reserved or pinned) are counted per segment and every entry is indexed by its
slot, so giving a segment back (`reclaim_segment`) looks at that segment's pages only, and
`close` walks the busy entries only: none of the three walks the whole pool.

The joints that follow this pool (`pools/joint.py`) are told of every key published
(commit) and every key that leaves (eviction, delete); so is its `log`, when someone
follows the pool (KV events, sidecar/events.py): `(True, key)` published, the key alone
gone (evicted or deleted: a page write that evicts logs a string, no tuple), in order,
with `on_log(pool)` called when the log stops being empty (a commit with `log=False` is
left to its caller, who logs it in its place).

The pool is single-threaded: its owner serializes calls (the sidecar calls it from the
event loop only; copies run elsewhere between reserve/pin and commit/unpin).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice, takewhile
from operator import itemgetter, or_
from typing import Final, Protocol

from pools.lru import LruList

RESERVED = 0
READY = 1
Taken = enum.Enum("Taken", "PRESENT BUSY")  # what reserve() answers for a key it holds:
PRESENT: Final = Taken.PRESENT  # the key is already stored: no copy needed
BUSY: Final = Taken.BUSY  # another writer is storing the key; it is not stored yet
EVICT_SCAN = 64  # pages `on_evict` keeps that one eviction passes over at most
RUN_WALK = 256  # given-back slots a new run's start moves down over at most
RECLAIM_TRIES = 4  # idle segments one reclaim tries to empty at most


class KeyWatcher(Protocol):
    """What a pool tells of its keys (`pools.joint.Joint` is one): a page published, a page
    gone. Called on the event loop, inside the pool's operation: it must not call back."""

    def added(self, pool: PagePool, key: str) -> None: ...

    def removed(self, pool: PagePool, key: str) -> None: ...


class PoolInvariantError(AssertionError):
    """A count or link of the pool is broken; raised, never clamped."""


@dataclass(slots=True, eq=False)
class Entry:
    """One page slot holding one key."""

    key: str
    offset: int
    state: int = RESERVED
    pins: int = 0
    doomed: bool = False
    prev: Entry | None = field(default=None, repr=False)
    next: Entry | None = field(default=None, repr=False)


def run_length(index: Mapping[str, object], keys: list[str]) -> int:
    """Length of the leading run of `keys` in `index`; stops at the first miss.

    When the last key is there the run is usually whole (a full hit, or a KV prefix
    probed in an extra pool): one `itemgetter` looks them all up in C, about 0.6x the
    walk, and a miss names its key, whose first position ends the run."""
    if keys and keys[-1] in index:
        try:
            itemgetter(*keys)(index)
        except KeyError as miss:
            return keys.index(miss.args[0])
        return len(keys)
    return len(list(takewhile(index.__contains__, keys)))


def run_in_any(keys: list[str], indexes: Sequence[Mapping[str, object]]) -> int:
    """Length of the leading run of `keys` each in some mapping of `indexes` (the host
    pool's READY keys, then each local tier's index), read in C: the first index's run by
    `run_length`, then chunks of doubling size, each key's presence in every index one
    `map` apiece, until a chunk holds a miss."""
    n, step, first = run_length(indexes[0], keys), 64, indexes[0].__contains__
    while n < len(keys):
        part = keys[n : n + step]
        held = bytes(map(first, part))
        for index in indexes[1:]:
            held = bytes(map(or_, held, map(index.__contains__, part)))
        end = held.find(0)
        if end >= 0:
            return n + end
        n, step = n + len(part), step * 2
    return n


Grow = Callable[["PagePool"], bool]
OnEvict = Callable[["PagePool", Entry], bool]  # False: keep this page (not written yet)


class PagePool:
    """Pages of one namespace. `grow` asks the host pool for one more segment."""

    def __init__(
        self,
        name: str,
        page_bytes: int,
        segment_size: int,
        max_pages: int | None = None,
        grow: Grow | None = None,
    ):
        if page_bytes <= 0 or page_bytes > segment_size:
            raise ValueError(f"page_bytes {page_bytes} must be in 1..segment size {segment_size}")
        self.name = name
        self.owner: Hashable = None  # the host pool shares segments fairly by owner
        self.page_bytes = page_bytes
        self.segment_size = segment_size
        self.max_pages = max_pages
        self.segments: list[int] = []
        self.entries: dict[str, Entry] = {}  # every key: RESERVED and READY
        self.ready: dict[str, Entry] = {}  # READY keys only: the lookup fast path
        self.free: dict[int, None] = {}  # slots given back, in that order; reused first
        self._next = -1  # the slot after the one handed out last: taken next when free
        self.fresh: list[list[int]] = []  # [next, end) of never-used slots, one run a segment
        self.lru: LruList[Entry] = LruList()
        self.reaping: list[dict[int, Entry] | dict[str, Entry]] = []  # dropped, for `reap`
        self.closed = False
        self.on_evict: OnEvict | None = None
        self.on_idle: Callable[[PagePool], None] | None = None
        self.on_segment_idle: Callable[[PagePool], None] | None = (
            None  # a segment's last busy slot went
        )
        self.joints: list[KeyWatcher] = []  # told when a key comes or goes
        self.log: list[str | tuple[object, object]] | None = None  # (True, key) or a gone key
        self.on_log: Callable[[PagePool], None] | None = None
        self._grow = grow
        self._doomed_entries: dict[int, Entry] = {}
        self._by_offset: dict[int, Entry] = {}  # every slot holding an entry (doomed too)
        self._busy: set[Entry] = set()  # entries reserved or pinned (doomed too)
        self._seg_busy: dict[int, int] = {}  # busy slots per segment (absent: idle)
        self._slots = 0
        self._reserved = 0
        self._pinned = 0  # entries with pins > 0, doomed ones included
        self.evictions = 0
        self.reclaim_kept = False  # the last reclaim met a page `on_evict` kept

    # -- capacity ---------------------------------------------------------------------
    @property
    def slots_per_segment(self) -> int:
        return self.segment_size // self.page_bytes

    @property
    def capacity_pages(self) -> int:
        return self._slots

    @property
    def ready_pages(self) -> int:
        return len(self.ready)

    @property
    def busy(self) -> int:
        """Entries that a copy may still be touching (reserved or pinned)."""
        return self._reserved + self._pinned

    def add_segment(self, index: int) -> int:
        """Take segment `index` (owned by the caller until now); return the slots added."""
        base = index * self.segment_size
        room = self.slots_per_segment
        if self.max_pages is not None:
            room = min(room, self.max_pages - self._slots)
        assert room > 0, "segment added to a pool that needs none"
        self.segments.append(index)
        self.fresh.append([base, base + room * self.page_bytes])
        self._slots += room
        return room

    @property
    def free_slots(self) -> int:
        return len(self.free) + sum((end - nxt) // self.page_bytes for nxt, end in self.fresh)

    def clear_free(self) -> None:
        """Forget every free slot (the host pool took the segments back)."""
        self.free.clear()
        self.fresh.clear()

    def wants_segment(self) -> bool:
        return self.max_pages is None or self._slots < self.max_pages

    # -- lookups ----------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return key in self.ready

    def prefix(self, keys: list[str]) -> int:
        """Length of the leading run of READY keys (no LRU touch); stops at the first miss."""
        return run_length(self.ready, keys)

    def present(self, keys: Iterable[str]) -> list[bool]:
        return list(map(self.ready.__contains__, keys))

    # -- writers ----------------------------------------------------------------------
    def reserve(self, key: str) -> Entry | Taken | None:
        """Return a RESERVED Entry to copy into, `PRESENT`, `BUSY` (being written by
        another reservation), or None when there is no room."""
        assert not self.closed, "reserve on a closed pool"
        e = self.entries.get(key)
        if e is not None:
            if e.state != READY:
                return BUSY
            if not e.pins:  # (a pinned page is off the list: it comes back as the newest)
                self.lru.touch(e)
            return PRESENT
        offset = self._take_slot()
        if offset is None:
            return None
        e = Entry(key, offset)
        self.entries[key] = e
        self._by_offset[offset] = e
        self._reserved += 1
        self._busy_on(e)
        return e

    def commit(self, e: Entry, log: bool = True) -> bool:
        """Publish a reservation; False when it was deleted meanwhile (slot freed).
        `log=False`: the caller logs it (KV events take a set's commits as one entry)."""
        self._check_reserved(e)
        self._reserved -= 1
        self._busy_off(e)
        if e.doomed:
            self._bury(e)
            return False
        e.state = READY
        self.ready[e.key] = e
        for joint in self.joints:
            joint.added(self, e.key)
        if log and self.log is not None:
            self._logged((True, e.key))
        self.lru.push_mru(e)
        self._after_release()
        return True

    def abort(self, e: Entry) -> None:
        self._check_reserved(e)
        self._reserved -= 1
        self._busy_off(e)
        if e.doomed:
            self._bury(e)
            return
        del self.entries[e.key]
        self._free_slot(e)
        self._after_release()

    # -- readers ----------------------------------------------------------------------
    def pin(self, key: str) -> Entry | None:
        """Pin a READY page: off the LRU list until its last unpin, which makes it the
        most recent; None when absent."""
        e = self.ready.get(key)
        if e is None:
            return None
        if e.pins == 0:
            self._pinned += 1
            self.lru.remove(e)
            self._busy_on(e)
        e.pins += 1
        return e

    def peek(self, keys: list[str]) -> list[Entry | None]:
        """The READY entries of `keys` (None where absent), marked most recent and NOT pinned:
        for a reader that is done with them before the pool is called again."""
        found = list(map(self.ready.get, keys))
        self.lru.touch_all([e for e in found if e is not None and not e.pins])
        return found

    def unpin(self, e: Entry) -> None:
        if e.pins <= 0:
            raise PoolInvariantError(f"unpin of {e.key!r} with pin count {e.pins}")
        e.pins -= 1
        if e.pins == 0:
            self._pinned -= 1
            self._busy_off(e)
            if e.doomed:
                self._bury(e)
                return
            self.lru.push_mru(e)
        self._after_release()

    # -- removal ----------------------------------------------------------------------
    def delete(self, key: str) -> bool:
        """Drop a key; True when a READY page was dropped."""
        e = self.entries.pop(key, None)
        if e is None:
            return False
        was_ready = e.state == READY
        if was_ready:
            del self.ready[key]
            for joint in self.joints:
                joint.removed(self, key)
            if self.log is not None:
                self._logged(key)
            if not e.pins:
                self.lru.remove(e)
        if e.state == RESERVED or e.pins > 0:
            e.doomed = True
            self._doomed_entries[id(e)] = e
        else:
            self._free_slot(e)
        return was_ready

    def evict_one(self) -> int | None:
        """Evict the least recent page `on_evict` lets go (the list holds no pinned one);
        its freed slot, or None. At most EVICT_SCAN pages it keeps are passed over: past
        them (write-back with a full queue, every page unwritten) the caller waits for the
        writer rather than have each reserve walk the whole pool on the event loop."""
        for e in islice(self.lru.from_lru(), EVICT_SCAN):
            if self._evict(e):
                return e.offset
        return None

    def idle_segments(self) -> int:
        """Segments that `reclaim_segment` could give back now (no slot reserved or pinned)."""
        return sum(1 for s in self.segments if s not in self._seg_busy)

    def reclaim_segment(self) -> int | None:
        """Give back one segment with no busy slot, its pages evicted: the segments of the
        EVICT_SCAN least recent pages first, then any idle one. Busy counts are kept per
        segment, so this walks no page but the reclaimed segment's own. At most
        RECLAIM_TRIES are tried: one holding a page `on_evict` keeps is skipped (its
        other pages may be gone)."""
        cold = [e.offset // self.segment_size for e in islice(self.lru.from_lru(), EVICT_SCAN)]
        tries, self.reclaim_kept = 0, False
        for seg in dict.fromkeys(cold + self.segments):
            if seg in self._seg_busy:
                continue
            if self._empty_segment(seg):
                return self._give_back(seg)
            self.reclaim_kept = True  # `on_evict` kept a page: try again once it is written
            tries += 1
            if tries >= RECLAIM_TRIES:
                break
        return None

    def _empty_segment(self, seg: int) -> bool:
        lo = seg * self.segment_size
        slots = range(lo, lo + self.slots_per_segment * self.page_bytes, self.page_bytes)
        held = [e for e in map(self._by_offset.get, slots) if e is not None]
        return all(self._evict(e) for e in held)

    def _give_back(self, seg: int) -> int:
        lo, hi = seg * self.segment_size, (seg + 1) * self.segment_size
        kept = {o: None for o in self.free if not lo <= o < hi}
        unused = [r for r in self.fresh if lo <= r[0] < hi]
        self._slots -= (
            len(self.free) - len(kept) + sum((e - n) // self.page_bytes for n, e in unused)
        )
        self.free = kept
        self.fresh = [r for r in self.fresh if not lo <= r[0] < hi]
        self.segments.remove(seg)
        return seg

    def close(self) -> None:
        """Drop every key and refuse new ones; `on_idle` fires once no copy holds a slot.
        With no joint or log to tell, only the busy entries are walked (they become
        doomed); the others leave the index at once, their slots with the segments (the
        host pool takes them back whole), and their objects a few at a time (`reap`):
        a namespace of millions of pages is dropped without a walk of them, or a free of
        them, in one turn of the event loop."""
        self.closed = True
        if self.joints or self.log is not None:
            for key in list(self.entries):
                self.delete(key)
        else:
            for e in self._busy:
                if not e.doomed:
                    e.doomed = True
                    self._doomed_entries[id(e)] = e
            self.reaping = [self._by_offset, self.entries]  # freed by `reap`
            self.entries = {}
            self.ready.clear()  # in place: a look-up holding `ready` across an await sees
            # the namespace gone (no entry is freed here: `reaping` still holds them all)
            self.lru = LruList()
            self._by_offset = {e.offset: e for e in self._busy}
        self._after_release()

    def reap(self, n: int) -> bool:
        """Free at most `n` of a closed pool's dropped entries, their LRU links broken (a
        linked chain would be left to the garbage collector's next full pass); True once
        none is left. The caller calls again on later loop turns."""
        while self.reaping and n > 0:
            d = self.reaping[-1]
            for _ in range(min(n, len(d))):
                e = d.popitem()[1]
                if e.prev is not None and not e.doomed:
                    e.prev = e.next = None
                n -= 1
            if not d:
                self.reaping.pop()
        return not self.reaping

    # -- internals --------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        slot = self._pop_free()
        if slot is None and self.wants_segment() and self._grow is not None and self._grow(self):
            slot = self._pop_free()
        if slot is None and self.evict_one() is not None:
            slot = self._pop_free()
        return slot

    def _pop_free(self) -> int | None:
        """A slot given back: the one after the slot handed out last when it is free
        (adjacent slots: see the module's doc), else one that starts a run; else the next
        never-used one (newest segment first: it follows the slot handed out last too)."""
        slot = self._next
        if slot in self.free:
            del self.free[slot]
        elif self.free:
            slot = self._run_start()
        elif self.fresh:
            slot = self._take_fresh()
        else:
            return None
        self._next = slot + self.page_bytes
        return slot

    def _take_fresh(self) -> int:
        run = self.fresh[-1]
        slot = run[0]
        run[0] += self.page_bytes
        if run[0] >= run[1]:
            self.fresh.pop()
        return slot

    def _run_start(self) -> int:
        """Take the given-back slot a new run starts at: the last one given back, moved
        down over the free slots just below it (at most RUN_WALK), so that the slots given
        back with it follow it in address order."""
        slot, free, step = next(reversed(self.free)), self.free, self.page_bytes
        for _ in range(RUN_WALK):
            if slot - step not in free:
                break
            slot -= step
        del free[slot]
        return slot

    def _evict(self, e: Entry) -> bool:
        assert e.pins == 0, "eviction of a pinned page"
        if self.on_evict is not None and not self.on_evict(self, e):
            return False
        self.lru.remove(e)
        del self.entries[e.key]
        del self.ready[e.key]
        for joint in self.joints:
            joint.removed(self, e.key)
        log = self.log
        if log is not None:  # `_logged`, inline: every page a set evicts comes here
            if not log:
                assert self.on_log is not None, "a pool with a log has its on_log"
                self.on_log(self)
            log.append(e.key)
        self._free_slot(e)
        self.evictions += 1
        return True

    def _logged(self, entry: str | tuple[object, object]) -> None:
        assert self.log is not None and self.on_log is not None, "called only with a log"
        if not self.log:
            self.on_log(self)
        self.log.append(entry)

    def _bury(self, e: Entry) -> None:
        del self._doomed_entries[id(e)]
        self._free_slot(e)
        self._after_release()

    def _free_slot(self, e: Entry) -> None:
        del self._by_offset[e.offset]
        self.free[e.offset] = None

    def _busy_on(self, e: Entry) -> None:
        """`e` is reserved or pinned now: its segment cannot be reclaimed."""
        self._busy.add(e)
        seg = e.offset // self.segment_size
        self._seg_busy[seg] = self._seg_busy.get(seg, 0) + 1

    def _busy_off(self, e: Entry) -> None:
        """`e` is committed, aborted or unpinned: its segment may go idle."""
        self._busy.remove(e)
        seg = e.offset // self.segment_size
        n = self._seg_busy[seg] = self._seg_busy[seg] - 1
        if not n:
            del self._seg_busy[seg]
            if self.on_segment_idle is not None:
                self.on_segment_idle(self)

    def _after_release(self) -> None:
        if self.closed and self.busy == 0 and self.on_idle is not None:
            self.on_idle(self)

    def _check_reserved(self, e: Entry) -> None:
        if e.state != RESERVED:
            raise PoolInvariantError(f"commit/abort of {e.key!r}, which is not reserved")

    def _check_slot_indexes(self) -> None:
        """The slot index, the busy entries and the busy count of each segment."""
        live = list(self.entries.values()) + list(self._doomed_entries.values())
        assert self._by_offset == {e.offset: e for e in live}, "slot index differs from the entries"
        busy = {e for e in live if e.state == RESERVED or e.pins}
        assert busy == self._busy, "busy entries differ from the reserved and pinned ones"
        per_seg = Counter(e.offset // self.segment_size for e in busy)
        assert per_seg == Counter(self._seg_busy) and 0 not in self._seg_busy.values(), (
            f"busy slots per segment {self._seg_busy} != {dict(per_seg)}"
        )

    def invariants(self) -> None:
        """Check every count and link; raise PoolInvariantError on the first broken one."""
        try:
            self._invariants()
        except AssertionError as exc:
            raise PoolInvariantError(f"pool {self.name!r}: {exc}") from exc

    def _invariants(self) -> None:
        listed = self.lru.check()
        reserved = pinned = 0
        offsets = list(self.free)
        for nxt, end in self.fresh:
            assert nxt < end and (end - nxt) % self.page_bytes == 0, (
                f"fresh run {nxt}..{end} is bad"
            )
            offsets.extend(range(nxt, end, self.page_bytes))
        for key, e in self.entries.items():
            assert e.key == key and not e.doomed, f"index entry {key!r} is stale"
            assert e.pins >= 0, f"{key!r} has negative pins"
            if e.state == RESERVED:
                assert e.pins == 0 and e.prev is None, f"reserved {key!r} is pinned or linked"
                reserved += 1
            elif e.pins:
                assert e.prev is None, f"pinned {key!r} is on the LRU list"
            else:
                assert e.prev is not None, f"unpinned ready {key!r} is not on the LRU list"
            pinned += e.pins > 0
            offsets.append(e.offset)
        for e in self._doomed_entries.values():
            assert e.doomed and e.prev is None, "doomed entry still linked"
            assert e.state == RESERVED or e.pins > 0, "doomed entry holds nothing"
            reserved += e.state == RESERVED
            pinned += e.pins > 0
            offsets.append(e.offset)
        assert listed == sum(e.state == READY and not e.pins for e in self.entries.values()), (
            "LRU != ready and unpinned"
        )
        assert self.ready == {k: e for k, e in self.entries.items() if e.state == READY}, (
            "ready index differs from the READY entries"
        )
        assert reserved == self._reserved, f"reserved count {self._reserved} != {reserved}"
        assert pinned == self._pinned, f"pinned count {self._pinned} != {pinned}"
        self._check_slot_indexes()
        # a closed pool forgets its idle slots: its segments go back whole
        assert len(offsets) == len(set(offsets)) and (
            len(offsets) == self._slots or self.closed and len(offsets) <= self._slots
        ), "slot lost or shared"
        segs = set(self.segments)
        assert len(segs) == len(self.segments), "segment listed twice"
        for o in offsets:
            seg, rel = divmod(o, self.segment_size)
            assert seg in segs and rel % self.page_bytes == 0, f"slot {o} misplaced"
        if self.max_pages is not None:
            assert self._slots <= self.max_pages, "pool grew past its cap"
