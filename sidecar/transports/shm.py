"""Shared-memory engine buffers: a file under an allowed directory, or a live process's memfd.

The sidecar maps the engine's memory `MAP_SHARED` and copies with memmove (ctypes releases
the GIL), so a copy runs at memcpy speed in a worker thread.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import stat
from typing import Optional, Sequence

from sidecar.errors import BadRequest, GeometryMismatch

_memmove = ctypes.memmove


def _resolve(path: Optional[str], pid: Optional[int], fd: Optional[int],
             allowed: Sequence[str]) -> str:
    """The path to open: `path` inside an allowed directory, or /proc/<pid>/fd/<fd> of a memfd."""
    if path is not None:
        if not isinstance(path, str) or not path.startswith("/"):
            raise BadRequest("'path' must be an absolute path")
        real = os.path.realpath(path)
        if not any(real.startswith(os.path.realpath(d).rstrip("/") + "/") for d in allowed):
            raise BadRequest(f"'path' {path!r} is outside the allowed shm directories {list(allowed)}")
        return real
    if not (isinstance(pid, int) and isinstance(fd, int)) or pid <= 0 or fd < 0:
        raise BadRequest("an shm buffer needs 'path', or 'pid' and 'fd' of a live process")
    proc = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(proc)
    except OSError as exc:
        raise BadRequest(f"cannot open fd {fd} of process {pid}: {exc.strerror}") from exc
    shared = any(target.startswith(os.path.realpath(d).rstrip("/") + "/") for d in allowed)
    if not (target.startswith("/memfd:") or shared):
        raise BadRequest(f"fd {fd} of process {pid} is {target!r}, not a memfd or shm file")
    return proc


class ShmMapping:
    """A writable MAP_SHARED mapping of an engine's buffer, with its base address."""

    __slots__ = ("size", "_mm", "_anchor", "address")

    def __init__(self, path: Optional[str], pid: Optional[int], fd: Optional[int], size: int,
                 allowed: Sequence[str]):
        target = _resolve(path, pid, fd, allowed)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_NOFOLLOW if path is not None else 0)
        try:
            handle = os.open(target, flags)
        except OSError as exc:
            raise BadRequest(f"cannot open {target!r}: {exc.strerror}") from exc
        try:
            st = os.fstat(handle)
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest(f"{target!r} is not a regular file or memfd")
            if st.st_size < size:
                raise GeometryMismatch(f"buffer size {size} is larger than the file ({st.st_size} bytes)")
            self._mm = mmap.mmap(handle, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(handle)
        self.size = size
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(self._anchor)

    @property
    def addresses(self) -> list[int]:
        return [self.address]

    def run_plan(self, plan) -> int:
        return run_plan(plan)

    def close(self) -> None:
        if self._mm is not None:
            self._anchor = None
            self._mm.close()
            self._mm = None


def run_plan(plan: Sequence[tuple[int, int, int]]) -> int:
    """Execute (dst, src, n) copies with memmove; return the bytes moved."""
    moved = 0
    for dst, src, n in plan:
        _memmove(dst, src, n)
        moved += n
    return moved

