"""Who owns a namespace, and which namespace a name means to whom.

A namespace made on the engine socket belongs to the peer's uid; one made on loopback TCP
belongs to the operator. Names are per owner: two uids may each have a "kv", and neither
can take (squat) a name the other will use. Inside the store a namespace is known by its
`ref`:

    made by          ref          who reaches it by its name
    uid 1000         kv@1000      peers of uid 1000; peers in `share_gid` (when the spec
                                  names one); the operator
    TCP              kv           the operator; anonymous TCP; peers in `share_gid`

    caller                   name "kv" means
    peer (uid u, groups G)   kv@u, else the oldest kv shared with one of G, else none
    operator (TCP, token)    the operator's kv, else the only kv of any owner (two or
                             more: 409, name one as kv@UID)
    anonymous (TCP, no token configured)   the operator's kv only

To anyone else a namespace does not exist (404 on every route, absent from listings).
Tier identity digests the owner (`owner_tag`), so tier pages stay as far apart as their
owners: a uid, a share group (every member's namespace of that name and spec is the
same), or the operator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Union

from sidecar.errors import Conflict, TooMany
from sidecar.peer import Peer

if TYPE_CHECKING:
    from sidecar.store import Namespace

MAX_PER_OWNER = 256        # namespaces one uid (or the operator) may hold
MAX_NAMESPACES = 4096      # in all


class _Operator:
    """TCP with the token (or the sidecar itself): every namespace."""
    __slots__ = ()

    def __repr__(self) -> str:
        return "OPERATOR"


class _Anonymous:
    """TCP on a sidecar with no token: anyone on the node; the operator's namespaces only."""
    __slots__ = ()

    def __repr__(self) -> str:
        return "ANONYMOUS"


OPERATOR, ANONYMOUS = _Operator(), _Anonymous()
Caller = Union[Peer, _Operator, _Anonymous]
MISSING = "@"   # a ref no namespace has: what an unknown name resolves to where 0 is the answer


def caller(peer: Optional[Peer], operator_tcp: bool) -> Caller:
    """The caller of a request with `peer` (None: TCP), on a sidecar whose TCP callers are
    the operator when `operator_tcp` (a token is configured)."""
    if peer is not None:
        return peer
    return OPERATOR if operator_tcp else ANONYMOUS


def owner_of(who: Caller) -> Optional[int]:
    """The owner a namespace made by `who` gets: a peer's uid, None for TCP."""
    return who.uid if isinstance(who, Peer) else None


def ref_of(name: str, owner: Optional[int]) -> str:
    return name if owner is None else f"{name}@{owner}"


def owner_tag(owner: Optional[int], share_gid: Optional[int]) -> str:
    """What a namespace's tier identity digests of its owner (see the module docstring)."""
    if share_gid is not None:
        return f"gid:{share_gid}"
    return "operator" if owner is None else f"uid:{owner}"


@dataclass(slots=True)
class Directory:
    """Namespaces by ref, and by name for the look-ups that fall back past the own one."""

    by_ref: dict
    by_name: dict
    version: int = 0    # one more each time a namespace comes or goes

    @classmethod
    def empty(cls) -> "Directory":
        return cls({}, {})

    def add(self, ns: "Namespace") -> None:
        self.by_ref[ns.ref] = ns
        self.by_name.setdefault(ns.name, []).append(ns)
        self.version += 1

    def remove(self, ns: "Namespace") -> None:
        del self.by_ref[ns.ref]
        same = self.by_name[ns.name]
        same.remove(ns)
        if not same:
            del self.by_name[ns.name]
        self.version += 1

    def check_room(self, owner: Optional[int]) -> None:
        """Before a new namespace of `owner`: the caps (429 past either)."""
        if len(self.by_ref) >= MAX_NAMESPACES:
            raise TooMany(f"the sidecar holds {MAX_NAMESPACES} namespaces, its limit; delete some")
        mine = sum(1 for ns in self.by_ref.values() if ns.owner == owner)
        if mine >= MAX_PER_OWNER:
            raise TooMany(f"at most {MAX_PER_OWNER} namespaces an owner; delete some first")

    def ref(self, name: str, who: Caller) -> str:
        """The ref `name` means to `who`, or MISSING (never raises for a peer)."""
        if isinstance(who, Peer):
            ref = f"{name}@{who.uid}"
            if ref in self.by_ref:
                return ref
            shared = self.shared(name, who)
            return shared.ref if shared is not None else MISSING
        if name in self.by_ref:
            return name if (who is OPERATOR or self.by_ref[name].owner is None) else MISSING
        if who is not OPERATOR:
            return MISSING
        same = self.by_name.get(name, ())
        if len(same) > 1:
            raise Conflict(f"namespace {name!r} exists for several owners "
                           f"({sorted(str(ns.owner) for ns in same)}); name one as {name}@UID")
        return same[0].ref if same else MISSING

    def shared(self, name: str, peer: Peer) -> Optional["Namespace"]:
        """The oldest namespace called `name` that another owner shares with `peer`."""
        for ns in self.by_name.get(name, ()):
            if ns.spec.share_gid is not None and ns.spec.share_gid in peer.groups:
                return ns
        return None

    def visible(self, who: Caller) -> Iterator["Namespace"]:
        """Every namespace `who` reaches by some name (listings, stats)."""
        for ns in self.by_ref.values():
            if self.reaches(who, ns):
                yield ns

    def reaches(self, who: Caller, ns: "Namespace") -> bool:
        if who is OPERATOR:
            return True
        if isinstance(who, Peer):
            return self.ref(ns.name, who) == ns.ref
        return ns.owner is None

    def label(self, ns: "Namespace", who: Caller) -> str:
        """The name `who` knows `ns` by: its name, or its ref for the operator when
        several owners have that name."""
        if who is OPERATOR and len(self.by_name.get(ns.name, ())) > 1:
            return ns.ref
        return ns.name
