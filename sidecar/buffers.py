"""Registered engine buffers: geometry, owner process, in-flight reference counts."""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from sidecar.errors import BadRequest
from sidecar.transports import cuda_ipc
from sidecar.transports.base import Chunk, _nonneg_int, parse_chunks
from sidecar.transports.shm import ShmMapping

TRANSPORTS = ("shm", "cuda_ipc")


def process_start(pid: int) -> Optional[str]:
    """The start time of `pid` from /proc (guards against pid reuse); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().rsplit(b")", 1)[1].split()
        return stat[19].decode()
    except (OSError, IndexError):
        return None


@dataclass(slots=True, eq=False)
class Buffer:
    """An engine buffer mapped into the sidecar. `refs` counts copies in flight."""

    id: str
    namespace: str
    transport: str
    size: int
    slots: int
    chunks: tuple[Chunk, ...]
    mapping: Any
    pid: Optional[int] = None
    pid_start: Optional[str] = None
    refs: int = 0
    released: bool = False

    def describe(self) -> dict[str, Any]:
        return {"buffer_id": self.id, "transport": self.transport, "size": self.size,
                "slots": self.slots, "pid": self.pid,
                "chunks": [{"offset": c.offset, "stride": c.stride, "size": c.size}
                           for c in self.chunks]}

    def owner_alive(self) -> bool:
        if self.pid is None:
            return True
        return process_start(self.pid) == self.pid_start

    def acquire(self) -> None:
        assert not self.released, "acquire of a released buffer"
        self.refs += 1

    def release_ref(self) -> None:
        assert self.refs > 0, "buffer reference count below zero"
        self.refs -= 1
        if self.released and self.refs == 0:
            self.mapping.close()

    def release(self) -> None:
        """Unregister; the mapping closes once the last in-flight copy ends."""
        if not self.released:
            self.released = True
            if self.refs == 0:
                self.mapping.close()


def open_buffer(namespace: str, body: Any, page_bytes: int, shm_dirs: Sequence[str],
                cuda: Any = None) -> Buffer:
    """Validate a registration body and map the engine's memory."""
    if not isinstance(body, dict):
        raise BadRequest("buffer registration must be a JSON object")
    transport = body.get("transport")
    if transport not in TRANSPORTS:
        raise BadRequest(f"'transport' must be one of {list(TRANSPORTS)}")
    size = _nonneg_int(body.get("size"), "'size'", 1)
    slots = _nonneg_int(body.get("slots"), "'slots'", 1)
    pid = body.get("pid")
    if pid is not None:
        pid = _nonneg_int(pid, "'pid'", 1)
    if transport == "cuda_ipc":
        regions = cuda_ipc.parse_regions(body, size)
        chunks = parse_chunks(body.get("chunks"), page_bytes, [r[3] for r in regions], slots)
        mapping = cuda_ipc.open_buffer(body, cuda, pid, size)
    else:
        chunks = parse_chunks(body.get("chunks"), page_bytes, size, slots)
        fd = body.get("fd")
        if body.get("path") is None and fd is not None:
            fd = _nonneg_int(fd, "'fd'")
        mapping = ShmMapping(body.get("path"), pid, fd, size, shm_dirs)
    start = process_start(pid) if pid is not None else None
    if pid is not None and start is None:
        mapping.close()
        raise BadRequest(f"process {pid} is not running")
    return Buffer("b-" + secrets.token_hex(8), namespace, transport, size, slots, chunks,
                  mapping, pid, start)
