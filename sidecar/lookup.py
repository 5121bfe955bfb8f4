"""Is this key present? The one query path: every route, the hybrid rule and the operator
controls ask here, never a pool or a tier directly.

    where a page may be            asked            how
    host pool (`pool.ready`)       on the loop      a dict, prefix runs in C
    local tiers (file, 3FS index)  on the loop      `Tiering.local_prefix` / `local_present`
    remote tiers (Mooncake)        awaited          `Tiering.remote_prefix` / `present`

Two questions, each asked near first and far only for what is left:

    run   the leading run of keys present (a KV prefix)        local_prefix -> remote_prefix
    mask  which of the keys are present (a pool's pages)       local_mask   -> mask / present

A key found in an index was validated when it was stored, so look-ups validate only the keys
they do not find (an unhashable entry falls through to the full check). Requests name a
namespace by ref (`Store.resolve`); `local_mask`, `local_run` and `mask` answer "nothing"
for a ref that does not exist (an extra pool the caller named, not yet made).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pools.joint import Joint
from sidecar.joints import Joints
from sidecar.keys import check_batch, check_keys
from sidecar.namespace import Namespace, Ref
from sidecar.tiering import Tiering


class Lookup:
    """Presence of keys in a namespace, host pool first, then the tiers. Each method takes
    a Ref; `prefix` (and the `local_prefix`, `remote_prefix` it calls) and `present` are
    typed str only while sidecar/controls.py calls them with its refs typed str."""

    def __init__(
        self,
        namespaces: Mapping[str, Namespace],
        namespace: Callable[[Ref], Namespace],
        tiering: Tiering,
        joints: Joints,
    ):
        self.namespaces = namespaces  # by ref (the store's, kept current by it)
        self.namespace = namespace  # by ref, or NamespaceNotFound
        self.tiering = tiering
        self.joints = joints

    # -- runs ---------------------------------------------------------------------------
    def local_prefix(self, ref: Ref, keys: Any) -> tuple[int, bool]:
        """(n, more): the leading run of keys in the host pool or a local tier, and whether
        a remote tier must still be asked about the rest (then call `remote_prefix`).
        `keys`: a request's JSON, validated here (BadRequest, InvalidKey)."""
        ns = self.namespace(ref)
        try:
            n = ns.pool.prefix(check_batch(keys))
        except TypeError:
            n = 0
        return self._local_past(ns, keys, n)

    def joint_walk(
        self, ref: Ref, keys: list[str], joint: Joint, bit: int
    ) -> tuple[int, bool, bytes]:
        """`local_prefix(ref, keys)`, and the masks (`pools.joint`) of the keys of the
        leading run `ref`'s pool (`bit` in `joint`, built) holds in the host pool: which
        pools of the joint hold each, in one walk for all of them."""
        ns = self.namespace(ref)
        try:
            masks = joint.walk(check_batch(keys), bit)
        except TypeError:  # an unhashable key: the full check below names it
            masks = b""
        return (*self._local_past(ns, keys, len(masks)), masks)

    def _local_past(self, ns: Namespace, keys: list[str], n: int) -> tuple[int, bool]:
        """`local_prefix` for a host-pool run of n keys: the local tiers go on from there."""
        if n == len(keys):
            return n, False
        check_keys(keys[n:])
        tiering = self.tiering
        if not tiering.enabled:
            return n, False
        n += tiering.local_prefix(ns.identity, keys[n:], ns.pool.ready)
        return n, n < len(keys) and tiering.remote

    async def remote_prefix(self, ref: Ref, keys: list[str], n: int) -> int:
        """`local_prefix`'s n, extended by what the remote tiers hold."""
        ns = self.namespace(ref)
        return n + await self.tiering.remote_prefix(ns.identity, keys[n:], ns.pool.ready)

    async def prefix(self, ref: Ref, keys: Any) -> int:
        """Longest run of keys from index 0 present in the host pool or any tier (`keys`:
        a request's JSON, validated by `local_prefix`)."""
        n, more = self.local_prefix(ref, keys)
        return await self.remote_prefix(ref, keys, n) if more else n

    def local_run(self, ref: Ref, keys: list[str], hi: int, known: int = 0) -> int:
        """The leading run of `keys[:hi]` in the host pool or a local tier, for keys already
        validated; stops at the first miss. `known`: a run the caller knows is there (the
        walk starts after it)."""
        ns = self.namespaces.get(ref)
        if ns is None:
            return 0
        n = known + ns.pool.prefix(keys[known:hi])
        if n < hi and self.tiering.enabled:
            n += self.tiering.local_prefix(ns.identity, keys[n:hi], ns.pool.ready)
        return n

    # -- masks --------------------------------------------------------------------------
    async def present(self, ref: Ref, keys: Any) -> list[bool]:
        """Each key's presence in the host pool or any tier (`keys`: a request's JSON,
        validated here)."""
        ns = self.namespace(ref)
        try:
            found = ns.pool.present(check_batch(keys))
        except TypeError:
            check_keys(keys)
            raise AssertionError("an unhashable key passed validation") from None
        missing = [k for k, hit in zip(keys, found, strict=True) if not hit]
        check_keys(missing)
        if self.tiering.enabled and missing:
            elsewhere = iter(await self.tiering.present(ns.identity, missing))
            found = [hit or next(elsewhere) for hit in found]
        return found

    def local_mask(self, ref: Ref, keys: list[str]) -> bytes:
        """One byte per key, 1 when in the host pool or a local tier; for keys already
        validated (a KV prefix)."""
        ns = self.namespaces.get(ref)
        if ns is None:
            return bytes(len(keys))
        found = bytes(map(ns.pool.ready.__contains__, keys))
        if self.tiering.enabled and 0 in found:
            found = _merge(found, self.tiering.local_present(ns.identity, _missing(found, keys)))
        return found

    async def mask(self, ref: Ref, keys: list[str]) -> bytes:
        """`local_mask`, with the remote tiers asked about what no local tier holds."""
        found = self.local_mask(ref, keys)
        ns = self.namespaces.get(ref)
        if ns is not None and self.tiering.remote and 0 in found:
            found = _merge(found, await self.tiering.present(ns.identity, _missing(found, keys)))
        return found

    # -- joints -------------------------------------------------------------------------
    def joint(self, kv: Ref, others: Sequence[Ref]) -> Joint | None:
        """The joint of namespace `kv`'s pool and the pools of `others` (`sidecar.joints`)."""
        return self.joints.get(kv, others)

    def make_joint(self, kv: Ref, others: Sequence[Ref]) -> Joint | None:
        """Make that joint when there is none and the bounds allow (ready now, or built
        over the next few loop turns); the joint, or None."""
        self.joints.make(kv, others, self.namespaces)
        return self.joints.get(kv, others)


def _missing(found: bytes, keys: list[str]) -> list[str]:
    return [k for k, hit in zip(keys, found, strict=True) if not hit]


def _merge(found: bytes, elsewhere_hits: Iterable[bool]) -> bytes:
    """`found` with each missing key's answer from `elsewhere_hits` (in the missing keys' order)."""
    elsewhere = iter(elsewhere_hits)
    return bytes(hit or next(elsewhere) for hit in found)
