"""Each node's index log on the 3FS mount: checksummed records, appended, tailed by the others.

    <root>/nodes/<node>/log.<gen>    records, appended by that node alone (`LogWriter`)
    <root>/nodes/<node>/snap.<gen>   that node's live pages when generation <gen> began

A record (little-endian), 72 bytes + the key:

    magic "KVL1" | op u8 | key length u8 | record length u16 | page hash u64 | node tag u64
    | identity 16 B | slot file u32 | slot u16 | reserved u16 | page length u32
    | page xxh3 u64 | wall time u64 (ns) | key | xxh3 of all before u64

    PUT  the page `hash` is at (file, slot) of this node; durable before the record was
    DEL  forget the copy of `hash` at (file, slot) of the node whose tag is `node` (a node
         deleting or evicting its own page, or asking the owner of another copy to)
    DROP forget every page of the identity (a deleted namespace)
    NEXT this log ends here: go on at log.<file> (compaction wrote snap.<file>)

Readers keep an offset at a record boundary and read past it (`parse`); a record that is
incomplete, or whose checksum fails within MAX_RECORD of the end, is a tail still being
written (or torn by a crash: the owner truncates it when it restarts): read again next
poll. A bad record with more than MAX_RECORD after it is damage: skipped, counted, and
reading resumes at the next record that checks (a miss for its page, never wrong bytes).

A snapshot: SNAP header, the identity table, the file table (file, page length, slots: u32),
then 16-byte entries (hash u64, identity no. << 48 | file << 6 | slot), then the xxh3 of
all before. A snapshot that does not check is not used (the previous generation is).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import struct
import threading
import time
from dataclasses import dataclass

import xxhash

from sidecar.tiers import pagefile
from sidecar.tiers.hf3fs_index import ENTRY

MAGIC = b"KVL1"
PUT, DEL, DROP, NEXT = 1, 2, 3, 4
_OPS = frozenset((PUT, DEL, DROP, NEXT))
HEAD = struct.Struct("<4sBBHQQ16sIHHIQQ")
SUM = struct.Struct("<Q")
MAX_KEY = 128
MAX_RECORD = HEAD.size + MAX_KEY + SUM.size
SNAP = struct.Struct("<8sQQQQ")  # magic, generation, identities, files, entries
SNAP_MAGIC = b"KVSNAP01"
FILE_ENTRY = struct.Struct("<III")  # file, page length, slots
KEY_OK = re.compile(rb"[0-9A-Za-z_.:\-]{1,128}")
NODE_NAME = re.compile(r"[0-9A-Za-z.\-]{1,80}")
_GEN = re.compile(r"(log|snap)\.([0-9]{8})")


@dataclass(slots=True)
class Record:
    op: int
    h: int
    node: int  # the tag of the node whose copy a DEL names (PUT: the writer's own)
    ident: bytes
    file: int
    slot: int
    length: int
    digest: int
    key: str


def node_tag(name: str) -> int:
    return xxhash.xxh3_64_intdigest(name.encode())


def encode(rec: Record) -> bytes:
    key = rec.key.encode()
    size = HEAD.size + len(key) + SUM.size
    head = HEAD.pack(
        MAGIC,
        rec.op,
        len(key),
        size,
        rec.h,
        rec.node,
        rec.ident,
        rec.file,
        rec.slot,
        0,
        rec.length,
        rec.digest,
        time.time_ns(),
    )
    body = head + key
    return body + SUM.pack(xxhash.xxh3_64_intdigest(body))


def _decode(buf, at: int) -> tuple[Record | None, int]:
    """(the record at `at`, its size); (None, 0): not whole yet; (None, -1): not a record."""
    if len(buf) - at < HEAD.size:
        return None, 0
    magic, op, klen, size, h, node, ident, file, slot, _, length, digest, _t = HEAD.unpack_from(
        buf, at
    )
    if magic != MAGIC or size != HEAD.size + klen + SUM.size or klen > MAX_KEY:
        return None, -1
    if len(buf) - at < size:
        return None, 0
    end = at + size - SUM.size
    if SUM.unpack_from(buf, end)[0] != xxhash.xxh3_64_intdigest(buf[at:end]):
        return None, -1
    key = bytes(buf[at + HEAD.size : end])
    if op not in (PUT, DEL, DROP, NEXT) or (klen and KEY_OK.fullmatch(key) is None):
        return None, -1
    return Record(op, h, node, ident, file, slot, length, digest, key.decode()), size


def parse(buf, final: bool = False) -> tuple[list[Record], int, int]:
    """(records, bytes consumed, damaged records skipped) of the bytes read at a record
    boundary. Stops at an incomplete or bad tail (read again later) unless `final` (a log
    that will not grow: a bad tail is damage then). The loop of every poll: kept lean (a
    whole record is checked inline; `_decode` sorts out the rest)."""
    out: list[Record] = []
    at = damaged = 0
    n, view = len(buf), memoryview(buf)
    unpack, digest, key_ok, head, ops = (
        HEAD.unpack_from,
        xxhash.xxh3_64_intdigest,
        KEY_OK,
        HEAD.size,
        _OPS,
    )
    while at < n:
        if n - at >= head:
            magic, op, klen, size, h, node, ident, file, slot, _, length, pd, _t = unpack(view, at)
            end = at + size - 8
            if (
                magic == MAGIC
                and size == head + klen + 8
                and end + 8 <= n
                and op in ops
                and int.from_bytes(view[end : end + 8], "little") == digest(view[at:end])
            ):
                key = bytes(view[at + head : end])
                if not klen or key_ok.fullmatch(key):
                    out.append(Record(op, h, node, ident, file, slot, length, pd, key.decode()))
                    at += size
                    if op == NEXT:  # the log ends: what may follow is not this generation's
                        break
                    continue
        rec, size = _decode(view, at)
        if size == 0 and not final:
            break  # a record still being written
        if not final and n - at <= MAX_RECORD:
            break  # a tail still being written, or torn: the owner truncates it
        nxt = buf.find(MAGIC, at + 1)
        damaged += 1
        if nxt < 0:
            at = n if final else max(at, n - MAX_RECORD)
            break
        at = nxt
    return out, at, damaged


# -- snapshots -----------------------------------------------------------------------
def encode_snapshot(gen: int, idents: list[bytes], files: list[tuple[int, int, int]], entries):
    """The snapshot bytes: `entries` is bytes of packed (hash, ident no. << 48 | low)."""
    head = SNAP.pack(SNAP_MAGIC, gen, len(idents), len(files), len(entries) // ENTRY)
    body = b"".join([head, *idents, *(FILE_ENTRY.pack(*f) for f in files), entries])
    return body + SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_snapshot(data: bytes) -> tuple[list[bytes], list[tuple[int, ...]], memoryview] | None:
    """(identities, files, entries) of a snapshot, or None when it does not check."""
    if len(data) < SNAP.size + SUM.size:
        return None
    body = memoryview(data)[: -SUM.size]
    if SUM.unpack_from(data, len(body))[0] != xxhash.xxh3_64_intdigest(body):
        return None
    magic, _gen, n_ident, n_files, n_entries = SNAP.unpack_from(data)
    at = SNAP.size
    size = at + 16 * n_ident + FILE_ENTRY.size * n_files + ENTRY * n_entries
    if magic != SNAP_MAGIC or size != len(body):
        return None
    idents = [bytes(body[at + 16 * i : at + 16 * i + 16]) for i in range(n_ident)]
    at += 16 * n_ident
    files = list(FILE_ENTRY.iter_unpack(body[at : at + FILE_ENTRY.size * n_files]))
    at += FILE_ENTRY.size * n_files
    return idents, files, body[at:]


def generations(names: list[str]) -> tuple[list[int], list[int]]:
    """(log generations, snapshot generations) among a node directory's names, sorted."""
    logs: list[int] = []
    snaps: list[int] = []
    for name in names:
        m = _GEN.fullmatch(name)
        if m:
            (logs if m.group(1) == "log" else snaps).append(int(m.group(2)))
    return sorted(logs), sorted(snaps)


def log_name(gen: int) -> str:
    return f"log.{gen:08d}"


def snap_name(gen: int) -> str:
    return f"snap.{gen:08d}"


def read_file(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return read_all(fd)
    finally:
        os.close(fd)


def read_all(fd: int, offset: int = 0) -> bytes:
    """Everything from `offset` to the end: one pread while the end is near."""
    parts: list[bytes] = []
    while True:
        chunk = os.pread(fd, 1 << 22, offset)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        offset += len(chunk)
        if len(chunk) < 1 << 22:
            return b"".join(parts)


class LogWriter:
    """This node's log: appends records durably (write, fsync: on 3FS the fsync also
    settles the file's length other clients see) one batch at a time. A
    failed append (ENOSPC, EIO) is cut off again, so the log never holds a torn record
    before a good one; `records` counts those since the generation began."""

    def __init__(self, directory: str, gen: int, mode: int, end: int = 0):
        """Go on appending to log.<gen> at `end` (what a reader found whole: a torn tail
        after it, from a crash mid-append, is cut off); a missing log is created."""
        self.directory, self.gen, self.mode = directory, gen, mode
        self.lock = threading.Lock()
        self.fd = -1
        if not os.path.exists(os.path.join(directory, log_name(gen))):
            self.end = self.records = self.kept = 0
            return  # made by the first append: a node that never writes makes no log
        self._open(gen)
        if os.fstat(self.fd).st_size > end:
            os.ftruncate(self.fd, end)
            os.fsync(self.fd)
        self.end = end
        self.records = end // 128  # about: compaction's hint
        self.kept = 0  # bytes of the files kept beside this log (snapshots, the last log)

    def _open(self, gen: int, truncate: bool = False) -> None:
        path = os.path.join(self.directory, log_name(gen))
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, self.mode)
        except FileExistsError:
            fd = os.open(path, flags)
            if truncate:
                os.ftruncate(fd, 0)
                os.fsync(fd)
        else:
            os.fchmod(fd, self.mode)
            os.fsync(fd)
            pagefile.fsync_dir(self.directory)
        self.fd, self.gen = fd, gen

    def append(self, blob: bytes) -> None:
        """Append records and make them durable; raises OSError with the log unchanged."""
        with self.lock:
            self._append(blob)

    def _append(self, blob: bytes) -> None:
        if self.fd < 0:
            self._open(self.gen)
        try:
            view, at = memoryview(blob), self.end
            while view:
                n = os.pwrite(self.fd, view, at)
                view, at = view[n:], at + n
            os.fsync(self.fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.end)
            raise
        self.end = at
        self.records += blob.count(MAGIC)  # (a key never holds it; a hash rarely: a hint)

    def switch(self, snapshot: bytes, gen: int) -> None:
        """Compaction, under `lock` held by the caller: publish snap.<gen>, create the
        empty log.<gen>, end this log with NEXT, go on there; remove generation gen - 2."""
        pagefile.publish(self.directory, snap_name(gen), snapshot, self.mode)
        old_fd, old_gen = self.fd, self.gen
        self._open(gen, truncate=True)  # (one left by a switch that failed after it)
        new_fd, self.fd, self.gen = self.fd, old_fd, old_gen
        try:
            self._append(encode(Record(NEXT, 0, 0, bytes(16), gen, 0, 0, 0, "")))
        except OSError:
            os.close(new_fd)
            raise
        os.close(old_fd)
        old_snap = _size(os.path.join(self.directory, snap_name(old_gen)))
        self.kept = len(snapshot) + self.end + old_snap
        self.fd, self.gen, self.end, self.records = new_fd, gen, 0, 0
        for stale in (log_name(gen - 2), snap_name(gen - 2)):
            pagefile._unlink(os.path.join(self.directory, stale))

    def size(self) -> int:
        return self.end + self.kept

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


class Tail:
    """Another node's log as this node reads it: an open fd and an offset at a record
    boundary. `read` is one pread when nothing is new."""

    CHUNK = 1 << 20

    def __init__(self, directory: str, gen: int):
        self.directory, self.gen = directory, gen
        self.offset = 0
        self.fd = os.open(
            os.path.join(directory, log_name(gen)), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        )
        self.damaged = 0

    def read(self) -> tuple[list[Record], bool]:
        """(the whole records past the offset in one pread, whether more may follow at
        once); the offset moves past them. A NEXT ends them: `follow` it."""
        data = os.pread(self.fd, self.CHUNK, self.offset)
        if not data:
            return [], False
        records, used, damaged = parse(data)
        self.damaged += damaged
        self.offset += used
        ended = bool(records) and records[-1].op == NEXT
        return records, not ended and used > 0 and len(data) == self.CHUNK

    def follow(self, gen: int) -> None:
        """Go on at log.<gen> (a NEXT record); raises OSError when it cannot be opened."""
        fd = os.open(
            os.path.join(self.directory, log_name(gen)), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        )
        os.close(self.fd)
        self.fd, self.gen, self.offset = fd, gen, 0

    def shrank(self) -> bool:
        """The log is shorter than what was read (rewritten after a lost tail): reload."""
        try:
            return os.fstat(self.fd).st_size < self.offset
        except OSError:
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def no_space(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)
