"""One page on disk: a header, then the page bytes at the header's `data offset`.

    offset 0                                                          64          data offset
    +---------+---------+-------------+-------------+--------+-----------------+ ... +---------------+
    | magic   | version | data offset | page length | page   | key     | head  |pad  | page bytes    |
    | 8 B     | u32     | u32         | u64         | xxh3   | xxh3    | xxh3  |     | (page length) |
    +---------+---------+-------------+-------------+--------+---------+-------+ ... +---------------+

The data offset is 4096 for pages written with O_DIRECT (a page of whole 4 KiB blocks in
aligned memory, such as an arena slot: no page-cache copy), and 64 otherwise (small or
unaligned pages, staged copies). Published by writing a unique temporary name in the same
directory, fdatasync, rename; the directory is fsynced after (once per batch). A file whose
size, magic, header checksum, key or page checksum is wrong is not a page: a miss.

Temporary names start with `~`, which no key holds (keys are [0-9A-Za-z_.:-]), and say
who writes them, so a scan removes only provably abandoned ones (`abandoned`):

    ~<node>~<boot>~<pid>~<random>.tmp     node: host name + pid namespace; boot: boot id
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import secrets
import socket
import struct
import threading
import time

import xxhash

MAGIC = b"KVSPAGE\x01"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")  # 40 bytes, then the header's own xxh3 (8 bytes)
HEADER_SIZE = 64
BLOCK = 4096  # the O_DIRECT alignment and data offset
SUFFIX = ".pg"
TMP_PREFIX = "~"
TEMP_MAX_AGE = 600.0  # seconds: any writer's temporary older is abandoned
_PAGE_NAME = re.compile(r"[0-9A-Za-z_.:\-]{1,128}\.pg")
_TEMP_NAME = re.compile(r"~([0-9A-Za-z.-]{1,80})~([0-9a-f]{1,32})~([0-9]{1,10})~[0-9a-f]{8}\.tmp")
_LEGACY_TEMP = re.compile(r"\..*\.pg\.tmp\.[0-9]+\.[0-9a-f]{8}")  # before temporaries began with ~
_local = threading.local()


def _node() -> str:
    """This node's name for temporaries: host name and pid namespace (a pid means one
    process only within one namespace)."""
    host = re.sub(r"[^0-9A-Za-z.-]", "-", socket.gethostname())[:60] or "host"
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{host}-{ns}"


def _boot() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:32] or "0"
    except OSError:
        return "0"


NODE, BOOT = _node(), _boot()


def is_page_name(name: str) -> bool:
    return _PAGE_NAME.fullmatch(name) is not None


page_name_match = _PAGE_NAME.fullmatch  # is_page_name without a Python frame (recovery's loop)


def temp_name() -> str:
    return f"{TMP_PREFIX}{NODE}~{BOOT}~{os.getpid()}~{secrets.token_hex(4)}.tmp"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def abandoned(name: str, mtime: float, now: float | None = None) -> bool:
    """True for a temporary no live writer can still publish: one of this node's from an
    earlier boot or of an exited process, or anyone's older than TEMP_MAX_AGE."""
    now = time.time() if now is None else now
    m = _TEMP_NAME.fullmatch(name)
    if m is None:
        return _LEGACY_TEMP.fullmatch(name) is not None and now - mtime > TEMP_MAX_AGE
    node, boot, pid = m.group(1), m.group(2), int(m.group(3))
    if node == NODE and (boot != BOOT or not _alive(pid)):
        return True
    return now - mtime > TEMP_MAX_AGE


def key_tag(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def page_name(key: str) -> str:
    """`<key>.pg`: keys are [0-9A-Za-z_.:-], so '.' and '..' become '..pg' and '...pg'."""
    return key + SUFFIX


def encode_header(key: str, page, data_offset: int = HEADER_SIZE) -> bytes:
    head = HEADER.pack(
        MAGIC, VERSION, data_offset, len(page), xxhash.xxh3_64_intdigest(page), key_tag(key)
    )
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    return head + bytes(data_offset - len(head))


def parse_header(raw: bytes, key: str, length: int) -> tuple[int, int]:
    """(data offset, page checksum), or (-1, -1) when it is not a valid header for `key`."""
    if len(raw) < HEADER_SIZE:
        return -1, -1
    magic, version, offset, size, digest, tag = HEADER.unpack_from(raw)
    (head_sum,) = struct.unpack_from("<Q", raw, HEADER.size)
    if (
        magic != MAGIC
        or version != VERSION
        or size != length
        or tag != key_tag(key)
        or offset not in (HEADER_SIZE, BLOCK)
    ):
        return -1, -1
    if head_sum != xxhash.xxh3_64_intdigest(raw[: HEADER.size]):
        return -1, -1
    return offset, digest


def _address(view: memoryview) -> int:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:  # read-only (a staged bytes copy): never O_DIRECT
        return 1


def direct_ok(page) -> bool:
    view = memoryview(page).cast("B")
    return len(view) % BLOCK == 0 and len(view) > 0 and _address(view) % BLOCK == 0


def write_temp(directory: str, key: str, page, mode: int = 0o600) -> tuple[str, int, int]:
    """Write header + page to a new temporary file in `directory` (not yet synced), readable
    by the owner only unless `mode` says more; return (its path, its open fd, its size)."""
    view = memoryview(page).cast("B")
    tmp = os.path.join(directory, temp_name())
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    direct = direct_ok(view)
    try:
        fd = os.open(tmp, flags | (os.O_DIRECT if direct else 0), mode)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        direct, fd = False, os.open(tmp, flags, mode)  # this file system has no O_DIRECT
    try:
        if mode != 0o600:
            os.fchmod(fd, mode)  # a group mode, whatever the umask
        head: bytes | mmap.mmap = encode_header(key, view, BLOCK if direct else HEADER_SIZE)
        if direct:  # O_DIRECT writes from an aligned buffer: the header's own block
            block = _header_block()
            block[:] = head
            head = block
        write_all(fd, [memoryview(head), view])
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    return tmp, fd, len(head) + len(view)


def _header_block() -> mmap.mmap:
    block = getattr(_local, "block", None)
    if block is None:
        block = _local.block = mmap.mmap(-1, BLOCK)  # page-aligned, for O_DIRECT
    return block


def write_all(fd: int, bufs: list) -> None:
    """Write every byte of `bufs` to `fd`, looping over short writes (page files, pin records)."""
    want = sum(len(b) for b in bufs)
    done = 0
    while done < want:
        n = os.writev(fd, bufs)
        done += n
        bufs = _advance(bufs, n)


def _advance(bufs: list, n: int) -> list:
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs = bufs[1:]
    if bufs and n:
        bufs = [bufs[0][n:], *bufs[1:]]
    return bufs


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(directory: str, name: str, data: bytes, mode: int) -> None:
    """Write `data` as `name` in `directory`: a unique temporary, fsync, rename, dir fsync."""
    tmp = os.path.join(directory, temp_name())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        write_all(fd, [memoryview(data)])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    os.close(fd)
    try:
        os.rename(tmp, os.path.join(directory, name))
    except BaseException:
        _unlink(tmp)
        raise
    fsync_dir(directory)


def read_into(path: str, key: str, dst: memoryview) -> bool:
    """Fill `dst` with the page at `path`; False when the file is not a whole, valid page.
    Raises OSError for I/O errors (a missing file is FileNotFoundError).

    An aligned destination is tried first as one O_DIRECT read of header + page (what an
    aligned writer produced); anything else is read through the page cache."""
    if direct_ok(dst):
        got = _try_direct(path, key, dst)
        if got is not None:
            return got
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        offset, digest = parse_header(os.pread(fd, HEADER_SIZE, 0), key, len(dst))
        if offset < 0 or size != offset + len(dst):
            return False
        if not _read_all(fd, dst, offset):
            return False
    finally:
        os.close(fd)
    return xxhash.xxh3_64_intdigest(dst) == digest


def _try_direct(path: str, key: str, dst: memoryview):
    """True/False for a page read with O_DIRECT, None when the file is not in that layout."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise
    try:
        if os.fstat(fd).st_size != BLOCK + len(dst):
            return None
        block = _header_block()
        want, got, bufs = BLOCK + len(dst), 0, [memoryview(block), dst]
        while got < want:
            n = os.preadv(fd, _advance(bufs, got), got)
            if n == 0:
                return False
            got += n
    finally:
        os.close(fd)
    offset, digest = parse_header(bytes(block[:HEADER_SIZE]), key, len(dst))
    if offset != BLOCK:
        return None if offset == HEADER_SIZE else False
    return xxhash.xxh3_64_intdigest(dst) == digest


def _read_all(fd: int, dst: memoryview, offset: int) -> bool:
    got = 0
    while got < len(dst):
        n = os.preadv(fd, [dst[got:]], offset + got)
        if n == 0:
            return False
        got += n
    return True


def remove(path: str) -> bool:
    """Unlink `path`; False when it was not there. Other errors (EROFS, EACCES, EIO) raise."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
