"""Slot files: the 3FS tier's pages, 64 of one length a file, preallocated, written once.

    <root>/nodes/<node>/<file:08x>.slot      SLOTS x stride bytes, made whole before use

    slot i at i x stride:  header (HEAD_ROOM bytes)            page bytes (length)
                           magic | version | length | page xxh3 | identity | key length | key
                           | xxh3 of the header before it

`stride` follows from the page length alone (`stride`): a large 4 KiB-aligned page gets a
4 KiB header block, so its bytes sit at an aligned offset (O_DIRECT, usrbio); any other a
256-byte header. A node whose --hf3fs-size holds fewer than 4 files of 64 gets smaller
files (`per_file`). A slot is written once and never again (a freed slot stays a hole until
its whole file goes), so no reader ever sees a published page being overwritten; an
unpublished slot (a crash mid-write) is never named by a log record. Every read checks the
header (magic, length, identity, key, its checksum) and the page's checksum: a torn,
damaged or foreign slot is a miss, never wrong bytes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import struct
import threading
from collections import OrderedDict

import xxhash

from sidecar.tiers import pagefile

SLOTS = 64
MAGIC = b"KVSLOT01"
HEAD = struct.Struct("<8sIIQ16sB")  # magic, version, length, page xxh3, identity, key length
SUM = struct.Struct("<Q")
VERSION = 1
BLOCK = 4096
SMALL_HEAD = 256
ALIGNED_FROM = 16 * BLOCK
NAME = re.compile(r"[0-9a-f]{8}\.slot")
_local = threading.local()


def head_room(length: int) -> int:
    """A 4 KiB header block before a large aligned page (its bytes at an aligned offset:
    O_DIRECT, usrbio), 256 bytes before any other."""
    return BLOCK if length >= ALIGNED_FROM and length % BLOCK == 0 else SMALL_HEAD


def stride(length: int) -> int:
    """Bytes a slot of a page of `length` takes (slots start on 512-byte boundaries)."""
    room = head_room(length)
    return room + length if room == BLOCK else -(-(room + length) // 512) * 512


def per_file(length: int, capacity: int | None) -> int:
    """Slots a new file gets: SLOTS, fewer only where --hf3fs-size holds under 4 files."""
    if capacity is None:
        return SLOTS
    return max(1, min(SLOTS, capacity // (4 * stride(length))))


def file_name(number: int) -> str:
    return f"{number:08x}.slot"


def encode_header(ident: bytes, key: str, page) -> bytes:
    k = key.encode()
    head = HEAD.pack(MAGIC, VERSION, len(page), xxhash.xxh3_64_intdigest(page), ident, len(k))
    head += k
    return head + SUM.pack(xxhash.xxh3_64_intdigest(head))


def check_header(raw, ident: bytes, key: str, length: int) -> int | None:
    """The page checksum a valid header for (ident, key, length) holds, else None."""
    k = key.encode()
    end = HEAD.size + len(k)
    if len(raw) < end + SUM.size:
        return None
    magic, version, size, digest, got_ident, klen = HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION or size != length or got_ident != ident:
        return None
    if klen != len(k) or bytes(raw[HEAD.size : end]) != k:
        return None
    if SUM.unpack_from(raw, end)[0] != xxhash.xxh3_64_intdigest(raw[:end]):
        return None
    return digest


def key_at(raw) -> tuple[bytes, str] | None:
    """(identity, key) a slot's header names, or None when it is not a valid header."""
    if len(raw) < HEAD.size:
        return None
    magic, version, _size, _digest, ident, klen = HEAD.unpack_from(raw)
    end = HEAD.size + klen
    if magic != MAGIC or len(raw) < end + SUM.size:
        return None
    if SUM.unpack_from(raw, end)[0] != xxhash.xxh3_64_intdigest(raw[:end]):
        return None
    return ident, bytes(raw[HEAD.size : end]).decode(errors="replace")


def create(directory: str, number: int, length: int, count: int, mode: int) -> int:
    """A new file of `count` slots for pages of `length`, its blocks allocated, published by rename
    (temporary, fsync, rename, directory fsync); its open read-write fd."""
    tmp = os.path.join(directory, pagefile.temp_name())
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        try:
            os.posix_fallocate(fd, 0, count * stride(length))
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, count * stride(length))  # a file system without fallocate
        os.fsync(fd)
        os.rename(tmp, os.path.join(directory, file_name(number)))
        pagefile.fsync_dir(directory)
    except BaseException:
        os.close(fd)
        pagefile._unlink(tmp)
        raise
    return fd


def write(fd: int, slot: int, ident: bytes, key: str, page) -> None:
    """Write the header and page into `slot` (not synced: the caller fdatasyncs)."""
    view = memoryview(page).cast("B")
    head = encode_header(ident, key, view)
    room = head_room(len(view))
    bufs: list = [memoryview(head + bytes(room - len(head))), view]
    at, want, done = slot * stride(len(view)), room + len(view), 0
    while done < want:
        done += os.pwritev(fd, pagefile._advance(bufs, done), at + done)


def read(fd: int, slot: int, ident: bytes, key: str, dst: memoryview) -> bool:
    """Fill `dst` from `slot`; False when it does not hold a whole, valid page of `key`."""
    room = head_room(len(dst))
    head = _head_buf(room)
    want, got, at = room + len(dst), 0, slot * stride(len(dst))
    bufs = [head, dst]
    while got < want:
        n = os.preadv(fd, pagefile._advance(bufs, got), at + got)
        if n == 0:
            return False
        got += n
    digest = check_header(head, ident, key, len(dst))
    return digest is not None and xxhash.xxh3_64_intdigest(dst) == digest


def read_key(fd: int, slot: int, length: int) -> tuple[bytes, str] | None:
    """(identity, key) in a slot's header, or None (for a DEL record when evicting)."""
    try:
        raw = os.pread(fd, SMALL_HEAD, slot * stride(length))
    except OSError:
        return None
    return key_at(raw)


def _head_buf(room: int) -> memoryview:
    buf = getattr(_local, "head", None)
    if buf is None:
        buf = _local.head = bytearray(BLOCK)
    return memoryview(buf)[:room]


class FdCache:
    """Open read-only fds of slot files by path, at most `size`; an fd in use is closed
    only when its last user gives it back (no read ever lands on a reused fd number)."""

    def __init__(self, size: int = 256):
        self.size = size
        self._fds: OrderedDict[str, list[int]] = OrderedDict()  # path -> [fd, users]
        self._lock = threading.Lock()
        self._retired: dict[int, int] = {}  # fd -> users, evicted while in use
        self.opens = 0

    def take(self, path: str) -> int:
        with self._lock:
            got = self._fds.get(path)
            if got is not None:
                got[1] += 1
                self._fds.move_to_end(path)
                return got[0]
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        with self._lock:
            self.opens += 1
            got = self._fds.get(path)
            if got is not None:  # another thread opened it meanwhile
                os.close(fd)
                got[1] += 1
                return got[0]
            self._fds[path] = [fd, 1]
            while len(self._fds) > self.size:
                _, (old, users) = self._fds.popitem(last=False)
                self._retire(old, users)
            return fd

    def give(self, path: str, fd: int) -> None:
        with self._lock:
            got = self._fds.get(path)
            if got is not None and got[0] == fd:
                got[1] -= 1
                return
            left = self._retired.get(fd, 1) - 1
            if left:
                self._retired[fd] = left
            else:
                self._retired.pop(fd, None)
                os.close(fd)

    def forget(self, path: str) -> None:
        """Close the cached fd of `path` (its file went) once no read holds it."""
        with self._lock:
            got = self._fds.pop(path, None)
            if got is not None:
                self._retire(*got)

    def _retire(self, fd: int, users: int) -> None:
        if users:
            self._retired[fd] = users
        else:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()
