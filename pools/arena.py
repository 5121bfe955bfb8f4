"""The host arena: one shared, prefaulted mapping that holds every page slot.

    memfd "kv-sidecar-arena" (or an unlinked /dev/shm file)
    +-----------+-----------+-----------+-----+-----------+
    | segment 0 | segment 1 | segment 2 | ... | segment n |   MAP_SHARED, MAP_POPULATE
    +-----------+-----------+-----------+-----+-----------+
    ^ address (handed to cudaHostRegister by the CUDA transport, when there is one)

Another process on the node can map the same bytes through `/proc/<pid>/fd/<fd>`.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import tempfile

_PAGE = mmap.PAGESIZE


class Arena:
    """A `MAP_SHARED` mapping of `size` bytes, backed by memory that is reserved up front."""

    __slots__ = ("size", "fd", "_mm", "_anchor", "address", "name")

    def __init__(self, size: int, name: str = "kv-sidecar-arena", shm_dir: str = "/dev/shm"):
        if size <= 0:
            raise ValueError(f"arena size must be > 0, got {size}")
        self.size = size
        self.name = name
        self.fd = _open_backing(name, shm_dir)
        try:
            os.posix_fallocate(self.fd, 0, size)  # reserve tmpfs pages now: no SIGBUS later
        except OSError as exc:
            os.close(self.fd)
            raise ValueError(f"cannot reserve {size} bytes of shared memory: {exc}") from exc
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mm: mmap.mmap | None = mmap.mmap(self.fd, size, flags=flags)
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(self._anchor)

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of `length` bytes at `offset` (no copy)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range [{offset}, {offset + length}) is outside the arena")
        assert self._mm is not None, "a view of a closed arena"
        return memoryview(self._mm)[offset : offset + length]

    def close(self) -> None:
        """Unmap and close; views still alive keep the mapping until they are released."""
        if self._mm is None:
            return
        self._anchor = None
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping
            self._mm.close()
        self._mm = None
        os.close(self.fd)

    @property
    def closed(self) -> bool:
        return self._mm is None


def _open_backing(name: str, shm_dir: str) -> int:
    if hasattr(os, "memfd_create"):
        try:
            return os.memfd_create(name, os.MFD_CLOEXEC)
        except OSError:
            pass
    fd, path = tempfile.mkstemp(prefix=name + "-", dir=shm_dir)
    os.unlink(path)
    return fd
