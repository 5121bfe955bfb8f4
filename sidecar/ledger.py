"""One ledger of what each owner holds (issue 52): every surface through which a caller
keeps host-pool memory busy is charged here, to the namespace's owner, against one bound.

    owner --Account-------------------------------------------------------------+
    |  held: segment -> holds   pins, gets and sets in flight, inline uploads,   |
    |                           inline answers not yet sent (each busy slot)     |
    |  pins: segment -> pins    the operator controls' pins (also in `held`)     |
    |  uploads: n               inline uploads in flight                         |
    +----------------------------------------------------------------------------+
    bound(owner)  = HostPool.owner_bound: its fair share of the segments (the shared
                    ones split among the owners of shared pools, itself counted, plus
                    its explicit ones); `held` never takes a new segment past it
    pins          at most PIN_SHARE of it (507 `pin_bound`)
    uploads       at most segments / UPLOADS_OWNER_SHARE an owner (>= 1), and segments /
                  UPLOADS_SHARE for every owner together (429); each holds its slot's
                  segment in `held`, so within the owner's share too

A busy slot keeps its whole segment from any reclaim, so holds are counted by the segments
they keep busy, not by pages or bytes: an owner that keeps pages busy in every segment it
took while alone (gets in flight on its own pages, answers nobody reads) still leaves the
rest of the pool to an owner that arrives, which grows into segments that go idle. A hold
past the bound is refused where it is asked for: a get's or set's page answers `false`
(counted in `refused`), an inline answer or upload is 429. Nothing is clamped: a count
given back twice raises (`invariants`).

Event subscriptions are not here: they have no owner (ZeroMQ peers), and are bounded in
total by the publisher (sidecar/publisher.py). Tier reads are queued per owner in lanes
(sidecar/tiering.py): an owner waits behind at most one read batch of another per thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pools import HostPool
from pools.page_pool import Entry
from sidecar.errors import TooMany

PIN_SHARE = 0.5  # of an owner's fair share of segments, its pins may hold at most
UPLOADS_OWNER_SHARE, UPLOADS_SHARE = 8, 2  # uploads in flight: see the module docstring


@dataclass(slots=True)
class Account:
    """What one owner holds."""

    held: Counter = field(default_factory=Counter)  # segment -> holds of any kind
    pins: Counter = field(default_factory=Counter)  # segment -> pinned pages (also held)
    uploads: int = 0
    refused: int = 0  # holds refused past its bound


class Hold:
    """The segments one request holds (a get, a set, an answer): given back once."""

    __slots__ = ("ledger", "owner", "segs")

    def __init__(self, ledger: Ledger, owner: Hashable):
        self.ledger, self.owner = ledger, owner
        self.segs: Counter[int] = Counter()  # segment -> holds this request took

    def take(self, offsets: Iterable[int]) -> list[bool]:
        """Hold the segment of each slot offset while the owner stays within its bound:
        True for each admitted. A segment it holds already is admitted only while it is
        within its bound: an owner over it (its share shrank as owners came) takes no new
        hold at all, so what it holds decays to the bound however often it asks."""
        acct = self.ledger.account(self.owner)
        seg_size = self.ledger.host_pool.segment_size
        bound = self.ledger.bound(self.owner)
        segs = [off // seg_size for off in offsets]
        admitted: dict[int, bool] = {}
        for seg, n in Counter(segs).items():  # each segment once, in order of first use
            held = len(acct.held)
            if held > bound or (held == bound and not acct.held[seg]):
                admitted[seg] = False
                acct.refused += n
                self.ledger.refused += n
                continue
            admitted[seg] = True
            acct.held[seg] += n
            self.segs[seg] += n
        out = [admitted[seg] for seg in segs]
        self.ledger._forget_idle(self.owner, acct)
        return out

    def release(self) -> None:
        segs, self.segs = self.segs, Counter()
        self.ledger.give(self.owner, segs)


class Ledger:
    """Every owner's account (on the event loop only)."""

    def __init__(self, host_pool: HostPool):
        self.host_pool = host_pool
        self.accounts: dict[Hashable, Account] = {}
        self.refused = 0  # holds refused past a bound, every owner

    def account(self, owner: Hashable) -> Account:
        acct = self.accounts.get(owner)
        if acct is None:
            acct = self.accounts[owner] = Account()
        return acct

    # -- bounds ------------------------------------------------------------------------
    def bound(self, owner: Hashable) -> int:
        """Segments `owner`'s holds of every kind may keep busy (at least one)."""
        return max(1, int(self.host_pool.owner_bound(owner)))

    def pin_bound(self, owner: Hashable) -> int:
        """Segments `owner`'s pins may hold: PIN_SHARE of its fair share."""
        return int(PIN_SHARE * self.host_pool.owner_bound(owner))

    # -- holds -------------------------------------------------------------------------
    def hold(self, owner: Hashable) -> Hold:
        return Hold(self, owner)

    def hold_moves(
        self, owner: Hashable, todo: list[tuple[int, Entry]], drop: Callable[[Entry], Any]
    ) -> tuple[list[tuple[int, Entry]], Hold]:
        """Charge the slots a move (a set's reserved, a get's pinned) keeps busy: (the
        (index, entry) pairs within the owner's bound, their hold); each of the rest is
        dropped (`drop`: abort a reservation, unpin a pin) and answers false."""
        hold = self.hold(owner)
        ok = hold.take(e.offset for _, e in todo)
        if all(ok):
            return todo, hold
        kept = []
        for (i, e), admitted in zip(todo, ok, strict=True):
            if admitted:
                kept.append((i, e))
            else:
                drop(e)
        return kept, hold

    def give(self, owner: Hashable, segs: Mapping[int, int]) -> None:
        """Give back `segs` (segment -> holds) of `owner`; a hold given twice raises."""
        if not segs:
            return
        acct = self.accounts[owner]
        for seg, k in segs.items():
            n = acct.held[seg] - k
            if n < 0:
                raise AssertionError(f"segment {seg} of {owner!r} given back twice")
            if n:
                acct.held[seg] = n
            else:
                del acct.held[seg]
        self._forget_idle(owner, acct)

    def held(self, owner: Hashable) -> int:
        """Segments `owner` keeps busy now."""
        acct = self.accounts.get(owner)
        return len(acct.held) if acct is not None else 0

    # -- pins (sidecar/controls/core.py) -----------------------------------------------------
    def pinned_segments(self, owner: Hashable) -> Counter:
        acct = self.accounts.get(owner)
        return acct.pins if acct is not None else Counter()

    def may_pin(self, owner: Hashable, segs: set[int], pin_bound: int, bound: int) -> bool:
        """Whether pinning pages in `segs` keeps `owner` within both bounds."""
        acct = self.accounts.get(owner) or Account()
        return len(acct.pins.keys() | segs) <= pin_bound and len(acct.held.keys() | segs) <= bound

    def pin(self, owner: Hashable, seg: int) -> None:
        acct = self.account(owner)
        acct.pins[seg] += 1
        acct.held[seg] += 1

    def unpin(self, owner: Hashable, seg: int) -> None:
        acct = self.accounts[owner]
        if acct.pins[seg] <= 0:
            raise AssertionError(f"a pin of segment {seg} of {owner!r} ended twice")
        acct.pins[seg] -= 1
        if not acct.pins[seg]:
            del acct.pins[seg]
        self.give(owner, {seg: 1})

    # -- inline uploads ----------------------------------------------------------------
    def check_upload(self, owner: Hashable) -> None:
        """429 when `owner` (or every owner together) holds as many uploads in flight as
        its part of the segments allows (module docstring)."""
        hp = self.host_pool
        mine = self.accounts[owner].uploads if owner in self.accounts else 0
        cap = hp.n_segments // UPLOADS_OWNER_SHARE  # (the owner's share: its `held` bound)
        if mine >= max(1, cap) or self.uploads() >= max(1, hp.n_segments // UPLOADS_SHARE):
            raise TooMany(
                "too many page uploads in flight; finish or send them whole "
                "(or move pages with buffers: POST .../set)"
            )

    def upload(self, owner: Hashable, n: int) -> None:
        """An upload of `owner` starts (n=1) or ends (n=-1)."""
        acct = self.account(owner)
        acct.uploads += n
        if acct.uploads < 0:
            raise AssertionError(f"an upload of {owner!r} ended twice")
        self._forget_idle(owner, acct)

    def uploads(self) -> int:
        return sum(a.uploads for a in self.accounts.values())

    # -- views -------------------------------------------------------------------------
    def usage(self, owner: Hashable) -> dict[str, int]:
        """What `owner` holds, in bytes of segments, against its bound."""
        seg = self.host_pool.segment_size
        acct = self.accounts.get(owner) or Account()
        return {
            "held_bytes": len(acct.held) * seg,
            "held_bound_bytes": self.bound(owner) * seg,
            "uploads": acct.uploads,
            "refused": acct.refused,
        }

    def describe(self) -> dict[str, int]:
        """Node totals without owners' names (/v1/stats `ledger`)."""
        return {
            "owners": len(self.accounts),
            "held_segments": sum(len(a.held) for a in self.accounts.values()),
            "pinned_segments": sum(len(a.pins) for a in self.accounts.values()),
            "uploads": self.uploads(),
            "refused": self.refused,
        }

    def invariants(self) -> None:
        for owner, acct in self.accounts.items():
            assert acct.uploads >= 0, (owner, acct)
            assert all(n > 0 for n in acct.held.values()), (owner, acct)
            assert all(0 < n <= acct.held[s] for s, n in acct.pins.items()), (owner, acct)

    def _forget_idle(self, owner: Hashable, acct: Account) -> None:
        if not (acct.held or acct.pins or acct.uploads):
            del self.accounts[owner]  # (its `refused` lives on in the node's total)
