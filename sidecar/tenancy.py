"""Who owns a namespace, and which namespace a name means to whom.

A namespace made on the engine socket belongs to the peer's uid; one made on loopback TCP
belongs to the operator (its token shown), to a TCP tenant (a token of `--tenant-tokens`
shown: `TcpTenant`, owner "tcp:NAME"), else to the anonymous TCP tenant (TCP_TENANT, no
token configured at all: anyone on the node, capped and shown only its own like any uid).
Names are per owner: two uids may each have a "kv", and neither can take (squat) a name
the other will use. Inside the store a
namespace is known by its `ref`:

    made by          ref          who reaches it by its name
    uid 1000         kv@1000      peers of uid 1000; peers in `share_gid` (when the spec
                                  names one); the operator
    TCP, token       kv           the operator; peers in `share_gid`
    TCP, tenant A    kv@tcp:A     TCP callers with A's token; the operator
    TCP, no token    kv           anonymous TCP (one sidecar has one of these two kinds)

`share_gid: G` is taken only from a member of G (its primary gid or a supplementary one as
`SO_PEERGROUPS` read them at its connect) or from the operator; anyone else gets 403
(`check_share`), anonymous TCP included. So a non-member never owns, joins, or has the tier
identity ("gid:G") of a namespace shared with G. The maker owns a shared namespace (it is
charged to the maker's share; only the maker or the operator deletes it); other members
that PUT an equal spec join it.

    caller                   name "kv" means
    peer (uid u, groups G)   kv@u, else the oldest kv shared with one of G that u joined
                             (a PUT of its spec), else none
    operator (TCP, token)    the operator's kv, else the only kv of any owner (two or
                             more: 409, name one as kv@UID)
    TCP tenant A (its token)               its own kv only (kv@tcp:A)
    anonymous (TCP, no token configured)   its own kv only (TCP_TENANT's)

To anyone else a namespace does not exist (404 on every route, absent from listings and
from /v1/stats, /metrics, /v1/cost and /v1/samples: only the operator sees every name).
Tier identity digests the owner (`owner_tag`), so tier pages stay as far apart as their
owners: a uid, a share group (every member's namespace of that name and spec is the
same), the operator, or anonymous TCP ("tcp": a sidecar restarted without its token does
not hand the operator's tier pages to anyone on the node).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from sidecar.errors import Conflict, Forbidden, TooMany
from sidecar.namespace import Namespace, Owner, Ref
from sidecar.peer import Peer
from sidecar.spec import NamespaceSpec

MAX_PER_OWNER = 256  # namespaces one uid (or the operator) may hold
MAX_NAMESPACES = 4096  # in all


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


@dataclass(frozen=True, slots=True)
class TcpTenant:
    """TCP with a tenant's token (`--tenant-tokens`, sidecar/credentials.py): a tenant
    like a uid, known by the name the tenants file gives it; never the operator."""

    name: str

    @property
    def owner(self) -> str:
        return f"{TCP_TENANT}:{self.name}"


OPERATOR, ANONYMOUS = _Operator(), _Anonymous()
TCP_TENANT = "tcp"  # the owner of what anonymous TCP makes: a tenant (uids are ints)
Caller = Peer | _Operator | _Anonymous | TcpTenant
MISSING = Ref("@")  # a ref no namespace has: what an unknown name resolves to where 0 is the answer


def caller(peer: Peer | None, operator_tcp: bool, tenant: TcpTenant | None = None) -> Caller:
    """The caller of a request with `peer` (None: TCP), on a sidecar whose TCP callers are
    the operator when `operator_tcp` (the Guard let it in with the operator's token),
    unless it showed a tenant's token (`tenant`). The engine socket never takes a token:
    its peer's credentials are its identity."""
    if peer is not None:
        return peer
    if tenant is not None:
        return tenant
    return OPERATOR if operator_tcp else ANONYMOUS


def owner_of(who: Caller) -> Owner:
    """The owner a namespace made by `who` gets: a peer's uid, None for the operator,
    TCP_TENANT for anonymous TCP, "tcp:NAME" for a TCP tenant with its own token."""
    if isinstance(who, Peer):
        return who.uid
    if isinstance(who, TcpTenant):
        return who.owner
    return None if who is OPERATOR else TCP_TENANT


def ref_of(name: str, owner: Owner) -> Ref:
    return Ref(name if owner is None or owner == TCP_TENANT else f"{name}@{owner}")


def owner_uid(owner: Owner) -> int | None:
    """What a description shows as `owner`: the uid, None for a namespace made on TCP."""
    return owner if isinstance(owner, int) else None


def owner_tag(owner: Owner, share_gid: int | None) -> str:
    """What a namespace's tier identity digests of its owner (see the module docstring)."""
    if share_gid is not None:
        return f"gid:{share_gid}"
    if owner is None:
        return "operator"
    if isinstance(owner, str):  # anonymous TCP ("tcp") or a TCP tenant ("tcp:NAME")
        return owner
    return f"uid:{owner}"


def check_share(who: Caller, share_gid: int | None) -> None:
    """403 unless `who` may name `share_gid`: a peer in that group, or the operator."""
    if share_gid is None or who is OPERATOR:
        return
    if isinstance(who, Peer) and share_gid in who.groups:
        return
    raise Forbidden(
        f"share_gid {share_gid} names a group this caller is not in; only its "
        f"members (on the engine socket) or the operator may share with it"
    )


@dataclass(slots=True)
class Directory:
    """Namespaces by ref, and by name for the look-ups that fall back past the own one."""

    by_ref: dict
    by_name: dict
    version: int = 0  # one more each time a namespace comes or goes

    @classmethod
    def empty(cls) -> Directory:
        return cls({}, {})

    def add(self, ns: Namespace) -> None:
        self.by_ref[ns.ref] = ns
        self.by_name.setdefault(ns.name, []).append(ns)
        self.version += 1

    def remove(self, ns: Namespace) -> None:
        del self.by_ref[ns.ref]
        same = self.by_name[ns.name]
        same.remove(ns)
        if not same:
            del self.by_name[ns.name]
        self.version += 1

    def check_room(self, owner: Owner) -> None:
        """Before a new namespace of `owner`: the caps (429 past either)."""
        if len(self.by_ref) >= MAX_NAMESPACES:
            raise TooMany(f"the sidecar holds {MAX_NAMESPACES} namespaces, its limit; delete some")
        mine = sum(1 for ns in self.by_ref.values() if ns.owner == owner)
        if mine >= MAX_PER_OWNER:
            raise TooMany(f"at most {MAX_PER_OWNER} namespaces an owner; delete some first")

    def ref(self, name: str, who: Caller) -> Ref:
        """The ref `name` means to `who`, or MISSING (never raises for a peer)."""
        if isinstance(who, Peer):
            ref = ref_of(name, who.uid)
            if ref in self.by_ref:
                return ref
            shared = self.shared(name, who)
            return shared.ref if shared is not None else MISSING
        if who is not OPERATOR:  # anonymous TCP or a TCP tenant: its own names only
            owner = owner_of(who)
            ref = ref_of(name, owner)
            ns = self.by_ref.get(ref)
            return ref if ns is not None and ns.owner == owner else MISSING
        if name in self.by_ref:
            return Ref(name)
        same = self.by_name.get(name, ())
        if len(same) > 1:
            raise Conflict(
                f"namespace {name!r} exists for several owners "
                f"({sorted(str(ns.owner) for ns in same)}); name one as {name}@UID"
            )
        return same[0].ref if same else MISSING

    def landing(self, name: str, spec: NamespaceSpec, who: Caller) -> Namespace | None:
        """Where a PUT of `name` with `spec` by `who` lands, if it exists: `who`'s own, else
        (a peer) the one shared with it under that spec. 403 first on a `share_gid` that
        `who` may not name (`check_share`)."""
        check_share(who, spec.share_gid)
        ns = self.by_ref.get(ref_of(name, owner_of(who)))
        if ns is None and isinstance(who, Peer):
            ns = self.shared(name, who, spec)
        return ns

    def shared(self, name: str, peer: Peer, spec: NamespaceSpec | None = None) -> Namespace | None:
        """The oldest namespace called `name` that another owner shares with `peer`: the one
        a PUT of `spec` joins, or (no spec) one `peer` joined by such a PUT. Being in the
        group is not enough: a name never means a namespace its caller did not ask for."""
        for ns in self.by_name.get(name, ()):
            if (
                ns.spec.share_gid is not None
                and ns.spec.share_gid in peer.groups
                and (ns.spec == spec if spec is not None else peer.uid in ns.joined)
            ):
                return ns
        return None

    def visible(self, who: Caller) -> Iterator[Namespace]:
        """Every namespace `who` reaches by some name (listings, stats)."""
        for ns in self.by_ref.values():
            if self.reaches(who, ns):
                yield ns

    def reaches(self, who: Caller, ns: Namespace) -> bool:
        if who is OPERATOR:
            return True
        if isinstance(who, Peer):
            return self.ref(ns.name, who) == ns.ref
        return ns.owner == owner_of(who)

    def label(self, ns: Namespace, who: Caller) -> str:
        """The name `who` knows `ns` by: its name, or its ref for the operator when
        several owners have that name."""
        if who is OPERATOR and len(self.by_name.get(ns.name, ())) > 1:
            return ns.ref
        return ns.name
