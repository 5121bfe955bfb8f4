"""One page on disk: a 64-byte header, then the page bytes.

    offset 0                                                         64
    +--------+---------+---------+-------------+-------------+--------+-------------------+
    | magic  | version | flags   | page length | page xxh3   | key    | header xxh3       |
    | 8 B    | u32     | u32     | u64         | u64         | xxh3   | (of bytes 0..48)  |
    |"KVSPAGE"|        |         |             |             | u64    | u64, then 8 B pad |
    +--------+---------+---------+-------------+-------------+--------+-------------------+
    | page bytes (page length) ...                                                        |

Published by writing a unique temporary name in the same directory, fsync, rename; the
directory is fsynced after (one fsync per directory per batch). A file whose size, magic,
header checksum, key or page checksum is wrong is not a page: readers treat it as a miss.
"""
from __future__ import annotations

import os
import secrets
import struct

import xxhash

MAGIC = b"KVSPAGE\x01"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")      # 40 bytes; + header xxh3 (8) + pad (16) = 64
HEADER_SIZE = 64
SUFFIX = ".pg"
TMP_MARK = ".tmp."


def key_tag(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def shard(key: str) -> str:
    return f"{key_tag(key) & 0xFF:02x}"


def page_name(key: str) -> str:
    """`<key>.pg`: keys are [0-9A-Za-z_.:-], so '.' and '..' become '..pg' and '...pg'."""
    return key + SUFFIX


def encode_header(key: str, page) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, 0, len(page), xxhash.xxh3_64_intdigest(page), key_tag(key))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + bytes(16)


def check_header(raw: bytes, key: str, length: int) -> int:
    """The page checksum from a header, or -1 when the header is not a valid one for `key`."""
    if len(raw) != HEADER_SIZE:
        return -1
    magic, version, _, size, digest, tag = HEADER.unpack_from(raw)
    (head_sum,) = struct.unpack_from("<Q", raw, HEADER.size)
    if magic != MAGIC or version != VERSION or size != length or tag != key_tag(key):
        return -1
    if head_sum != xxhash.xxh3_64_intdigest(raw[:HEADER.size]):
        return -1
    return digest


def write_temp(directory: str, key: str, page) -> str:
    """Write header + page to a new temporary file in `directory`, fsync it; return its path."""
    tmp = os.path.join(directory, f".{page_name(key)}{TMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        header = encode_header(key, page)
        want, done = HEADER_SIZE + len(page), 0
        bufs = [memoryview(header), memoryview(page).cast("B")]
        while done < want:
            n = os.writev(fd, bufs)
            done += n
            bufs = _advance(bufs, n)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    os.close(fd)
    return tmp


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


def read_into(path: str, key: str, dst: memoryview) -> bool:
    """Fill `dst` with the page at `path`; False when the file is not a whole, valid page.
    Raises OSError for I/O errors (a missing file is FileNotFoundError)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != HEADER_SIZE + len(dst):
            return False
        digest = check_header(os.pread(fd, HEADER_SIZE, 0), key, len(dst))
        if digest < 0:
            return False
        got = 0
        while got < len(dst):
            n = os.preadv(fd, [dst[got:]], HEADER_SIZE + got)
            if n == 0:
                return False
            got += n
    finally:
        os.close(fd)
    return xxhash.xxh3_64_intdigest(dst) == digest


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
