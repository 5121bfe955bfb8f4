"""Shared-memory engine buffers, from a file descriptor the engine proved it holds.

The sidecar never opens an engine's memory by a name it was told: it gets the descriptor
itself (lent on the fd socket, see `sidecar.leases`) or opens a file race-free beneath an
allowed directory and checks its owner (`open_beneath`). Then one of two copy modes:

    memfd that accepts F_SEAL_SHRINK (tmpfs)  ->  mmap MAP_SHARED, memmove   (fast path)
    anything else (an unsealable memfd such   ->  pread / pwrite on the fd    (no SIGBUS)
    as SGLang's, a /dev/shm file)

A mapping of a file its owner may truncate would kill the sidecar with SIGBUS at the next
copy; once sealed against shrinking it cannot be truncated, and pread/pwrite on an unsealed
file answer a short count or an errno instead, which the store turns into `false`.
Only the bytes the chunks cover are mapped (`span`), and nothing here runs on the event
loop: the sidecar builds, copies with and closes these mappings on its lane threads
(`sidecar.lanes`), since a tenant can hold its memfd's inode lock or punch holes under a copy.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Sequence

from sidecar.errors import BadRequest, Forbidden, GeometryMismatch, TooMany
from sidecar.transports.base import CopyFailed

try:  # C (sidecar/_kvcopy.c), built at install where a compiler is: the runs without the GIL
    from sidecar import _kvcopy
except ImportError:  # no compiler at install: ctypes.memmove a run at a time
    _kvcopy = None  # type: ignore[assignment]

STREAM_MIN = 4 << 20  # plans of this many bytes and more bypass the cache (_kvcopy.c)
_memmove = ctypes.memmove
_libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL around these calls
_pread, _pwrite = _libc.pread, _libc.pwrite
for _f in (_pread, _pwrite):
    _f.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long)
    _f.restype = ctypes.c_ssize_t
_fstatfs = _libc.fstatfs
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6


def open_beneath(path: object, allowed: Sequence[str]) -> int:
    """Open `path` read-write, walking from the allowed directory that contains it one
    component at a time with O_NOFOLLOW: a symlink anywhere (swapped in at any moment)
    fails the open instead of leading outside. The caller checks the owner."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise BadRequest("'path' must be an absolute path")
    for root in allowed:
        prefix = root.rstrip("/") + "/"
        if path.startswith(prefix):
            break
    else:
        raise BadRequest(
            f"'path' must lie under one of the allowed shm directories {list(allowed)}"
        )
    parts = path[len(prefix) :].split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise BadRequest("'path' must not contain empty, '.' or '..' components")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise BadRequest(
            f"the shm directory cannot be opened: {os.strerror(exc.errno or errno.EIO)}"
        ) from None
    try:
        for part in parts[:-1]:
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(
            parts[-1], os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd
        )
    except OSError as exc:
        raise BadRequest(
            f"cannot open the registered 'path': {os.strerror(exc.errno or errno.EIO)} "
            f"(symlinks are not followed)"
        ) from None
    finally:
        os.close(fd)


def _sealed(fd: int) -> bool:
    """Seal a memfd against shrinking; True when it is (now or already) sealed so and on
    tmpfs, i.e. safe to map."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except OSError as exc:
        if exc.errno != errno.EPERM:  # EINVAL: not a memfd
            return False
        try:
            if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                return False
        except OSError:
            return False
    return fs_type(fd) == TMPFS_MAGIC


def fs_type(fd: int) -> int:
    """The f_type of the file system `fd` lives on (statfs; -1 when it cannot say)."""
    buf = ctypes.create_string_buffer(128)  # struct statfs; f_type comes first
    if _fstatfs(fd, buf) != 0:
        return -1
    return int.from_bytes(buf.raw[:8], "little")


class ShmMapping:
    """An engine buffer: the fd it was registered with (owned from here on), mapped when
    sealed, only over `span` (the bytes its chunks cover; default all of `size`), unless
    `refusal` (no room to map: raised then). `addresses` are mapping addresses, or file
    offsets (base 0) in fd mode; `mapped` is the bytes of address space it holds."""

    __slots__ = ("size", "fd", "ident", "sealed", "mapped", "_mm", "_anchor", "address")

    def __init__(
        self,
        fd: int,
        size: int,
        forbidden: Sequence[tuple[int, int]] = (),
        span: tuple[int, int] | None = None,
        refusal: Exception | None = None,
    ):
        self.fd, self.mapped, self.address = fd, 0, 0
        self._mm: mmap.mmap | None = None
        self._anchor: ctypes.c_char | None = None
        try:
            self.sealed = _sealed(fd)  # before the size check: it cannot shrink after
            st = os.fstat(fd)
            self.ident = (st.st_dev, st.st_ino)
            if self.ident in forbidden:
                raise Forbidden("that memory belongs to the sidecar and cannot be registered")
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest("the registered fd is not a regular file or memfd")
            if st.st_size < size:
                raise GeometryMismatch(
                    f"buffer size {size} is larger than the file ({st.st_size} bytes)"
                )
            if self.sealed and refusal is not None:  # no room to map it (fd mode would be)
                raise refusal
            if self.sealed:
                self._map(fd, span or (0, size))
        except BaseException:
            os.close(fd)
            raise
        self.size = size

    def _map(self, fd: int, span: tuple[int, int]) -> None:
        start = span[0] - span[0] % mmap.ALLOCATIONGRANULARITY
        try:
            mm = mmap.mmap(fd, span[1] - start, flags=mmap.MAP_SHARED, offset=start)
        except OSError as exc:
            if exc.errno == errno.ENOMEM:  # the address space is full: the caller's 4xx
                raise TooMany(
                    f"the sidecar cannot map {span[1] - start} more bytes now "
                    f"(out of address space); release buffers or register smaller ones"
                ) from None
            self.sealed = False  # e.g. a write-sealed memfd cannot be mapped writable: use the fd
            return
        self._mm, anchor = mm, ctypes.c_char.from_buffer(mm)
        self._anchor = anchor
        self.mapped = span[1] - start
        self.address = ctypes.addressof(anchor) - start

    @property
    def addresses(self) -> list[int]:
        return [self.address]

    def run_plan(self, plan, into_engine: bool) -> int:
        if self._mm is not None:
            return run_plan(plan)
        return _fd_plan(self.fd, plan, into_engine)

    def close(self) -> None:
        if self._mm is not None:
            self._anchor = None
            self._mm.close()
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def run_plan(plan: Sequence[tuple[int, int, int]]) -> int:
    """Execute (dst, src, n) copies; return the bytes moved. In C where built: one call,
    the GIL released for the whole plan, and a large plan's stores streamed past the
    cache (a restore's destination is written, not read); else memmove a run at a time."""
    if _kvcopy is not None and type(plan) is list:
        return _kvcopy.run_plan(plan, STREAM_MIN)
    moved = 0
    for dst, src, n in plan:
        _memmove(dst, src, n)
        moved += n
    return moved


def _fd_plan(fd: int, plan: Sequence[tuple[int, int, int]], into_engine: bool) -> int:
    """(dst, src, n) copies where the engine side is a file offset: pwrite into the engine's
    file on a get, pread from it on a set. A short read (the file shrank) or an errno
    raises CopyFailed; nothing faults."""
    moved = 0
    for dst, src, n in plan:
        done = 0
        while done < n:
            if into_engine:
                got = _pwrite(fd, src + done, n - done, dst + done)
            else:
                got = _pread(fd, dst + done, n - done, src + done)
            if got <= 0:
                err = ctypes.get_errno() if got < 0 else 0
                raise CopyFailed(os.strerror(err) if err else "the engine's buffer shrank")
            done += got
        moved += n
    return moved
