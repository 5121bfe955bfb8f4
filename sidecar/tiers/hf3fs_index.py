"""The 3FS tier's in-memory index: page hash -> where the page lives, ~22 bytes a page.

    hash  xxh3_64(identity bytes + key), never 0            (`page_hash`)
    where identity no. << 48 | node no. << 36 | file << 6 | slot   (`pack` / `unpack`)

A dict of int -> int costs ~114 bytes a page (two int objects and a dict entry); this table
keeps 16 bytes an entry in 65,536 bucket bytearrays chosen by the hash's low bits, found by
`bytearray.find` (memchr speed). Buckets never split, so no insert ever rehashes the whole
table under the lock (at 10 M pages a bucket holds ~150 entries, 2.4 KB to search).

Identity and node numbers are this process's own (`IdentityTable`, the tier's node list):
the logs on disk name identities by their 16 bytes and nodes by their tags.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import xxhash

BUCKET_BITS = 16
ENTRY = 16
SLOT_BITS = 6  # 64 pages a slot file
FILE_BITS = 30
NODE_BITS = 12
IDENT_BITS = 16
MAX_NODES = 1 << NODE_BITS
MAX_IDENTS = 1 << IDENT_BITS
MAX_FILE = (1 << FILE_BITS) - 1
_FILE_SHIFT = SLOT_BITS
_NODE_SHIFT = SLOT_BITS + FILE_BITS
_IDENT_SHIFT = _NODE_SHIFT + NODE_BITS
_LOW = (1 << _NODE_SHIFT) - 1  # file and slot: what a snapshot stores of a location


def page_hash(ident: bytes, key: str) -> int:
    """The index's key for page `key` of the identity whose 16 bytes are `ident`."""
    return xxhash.xxh3_64_intdigest(ident + key.encode()) or 1


def pack(ident_no: int, node_no: int, file: int, slot: int) -> int:
    return ident_no << _IDENT_SHIFT | node_no << _NODE_SHIFT | file << _FILE_SHIFT | slot


def unpack(where: int) -> tuple[int, int, int, int]:
    """(identity no., node no., file, slot) of a packed location."""
    return (
        where >> _IDENT_SHIFT,
        where >> _NODE_SHIFT & (MAX_NODES - 1),
        where >> _FILE_SHIFT & MAX_FILE,
        where & ((1 << SLOT_BITS) - 1),
    )


def low(where: int) -> int:
    """File and slot of a packed location (a snapshot's entry without its node)."""
    return where & _LOW


class CompactIndex:
    """hash -> packed location; not thread-safe (the tier holds its lock around it)."""

    __slots__ = ("_buckets", "_mask", "_len")

    def __init__(self, bits: int = BUCKET_BITS):
        self._buckets: list[bytearray | None] = [None] * (1 << bits)
        self._mask = (1 << bits) - 1
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _find(self, buf: bytearray, pat: bytes) -> int:
        i = buf.find(pat)
        while i >= 0 and i % ENTRY:  # matched across two entries: look further
            i = buf.find(pat, i + 1)
        return i

    def get(self, h: int) -> int | None:
        buf = self._buckets[h & self._mask]
        if buf is None:
            return None
        i = self._find(buf, h.to_bytes(8, "little"))
        return None if i < 0 else int.from_bytes(buf[i + 8 : i + ENTRY], "little")

    def put(self, h: int, where: int) -> int | None:
        """Set `h` to `where`; the location it replaces, or None when it is new."""
        b = h & self._mask
        buf, pat = self._buckets[b], h.to_bytes(8, "little")
        if buf is None:
            self._buckets[b] = bytearray(pat + where.to_bytes(8, "little"))
            self._len += 1
            return None
        i = self._find(buf, pat)
        if i < 0:
            buf += pat + where.to_bytes(8, "little")
            self._len += 1
            return None
        old = int.from_bytes(buf[i + 8 : i + ENTRY], "little")
        buf[i + 8 : i + ENTRY] = where.to_bytes(8, "little")
        return old

    def remove(self, h: int, where: int | None = None) -> int | None:
        """Remove `h` (only while it points to `where`, when given); the location removed."""
        b = h & self._mask
        buf = self._buckets[b]
        if buf is None:
            return None
        i = self._find(buf, h.to_bytes(8, "little"))
        if i < 0:
            return None
        old = int.from_bytes(buf[i + 8 : i + ENTRY], "little")
        if where is not None and old != where:
            return None
        last = len(buf) - ENTRY
        if i != last:
            buf[i : i + ENTRY] = buf[last:]
        del buf[last:]
        if not buf:
            self._buckets[b] = None
        self._len -= 1
        return old

    def remove_where(self, doomed: Callable[[int], bool]) -> list[tuple[int, int]]:
        """Remove every entry whose location `doomed` names; the (hash, location) removed.
        A walk of the whole table (a dropped identity, a node reloaded): rare."""
        gone = []
        for b, buf in enumerate(self._buckets):
            if buf is None:
                continue
            keep = bytearray()
            for i in range(0, len(buf), ENTRY):
                where = int.from_bytes(buf[i + 8 : i + ENTRY], "little")
                if doomed(where):
                    gone.append((int.from_bytes(buf[i : i + 8], "little"), where))
                else:
                    keep += buf[i : i + ENTRY]
            if len(keep) != len(buf):
                self._buckets[b] = keep or None
        self._len -= len(gone)
        return gone

    def items(self) -> Iterator[tuple[int, int]]:
        for buf in self._buckets:
            if buf is not None:
                for i in range(0, len(buf), ENTRY):
                    yield (
                        int.from_bytes(buf[i : i + 8], "little"),
                        int.from_bytes(buf[i + 8 : i + ENTRY], "little"),
                    )


class IdentityTable:
    """Namespace identities (32 hex) <-> this process's small numbers, with page counts."""

    def __init__(self) -> None:
        self.numbers: dict[bytes, int] = {}
        self.raw: list[bytes] = []
        self.counts: list[int] = []

    def number(self, ident: bytes) -> int | None:
        """The number of the identity's 16 bytes, given one if new (None: table full)."""
        n = self.numbers.get(ident)
        if n is None:
            if len(self.raw) >= MAX_IDENTS:
                return None
            n = self.numbers[ident] = len(self.raw)
            self.raw.append(ident)
            self.counts.append(0)
        return n

    def find(self, identity: str) -> int | None:
        """The number of a known identity (hex), or None."""
        try:
            return self.numbers.get(bytes.fromhex(identity))
        except ValueError:
            return None

    def hex(self, n: int) -> str:
        return self.raw[n].hex()
