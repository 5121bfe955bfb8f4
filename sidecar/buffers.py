"""Registered engine buffers: geometry, owner, in-flight reference counts.

Who may register what (the trust rule of docs/security.md):

    transport  form            where             proof
    shm        "lease"         engine socket     the fd itself, lent with SCM_RIGHTS
    shm        "path"          engine socket     O_NOFOLLOW walk + file owner == peer uid
    cuda_ipc   "handle"        socket or TCP     the IPC handle (a capability; token on TCP)

A buffer registered on the engine socket is usable only by peers with the registering uid.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from sidecar.errors import BadRequest, Forbidden
from sidecar.leases import LeaseRegistry
from sidecar.peer import Peer
from sidecar.transports import cuda_ipc
from sidecar.transports.base import Chunk, _nonneg_int, parse_chunks
from sidecar.transports.shm import ShmMapping, open_beneath

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
    pid: Optional[int] = None          # released when this process exits (polled)
    pid_start: Optional[str] = None
    owner_uid: Optional[int] = None    # None: registered on TCP (cuda_ipc only)
    lease: Optional[str] = None        # released when this lease ends
    refs: int = 0
    released: bool = False

    def describe(self) -> dict[str, Any]:
        return {"buffer_id": self.id, "transport": self.transport, "size": self.size,
                "slots": self.slots, "pid": self.pid, "owner_uid": self.owner_uid,
                "mode": "mmap" if getattr(self.mapping, "sealed", True) else "fd",
                "chunks": [{"offset": c.offset, "stride": c.stride, "size": c.size}
                           for c in self.chunks]}

    def usable_by(self, peer: Optional[Peer]) -> bool:
        return self.owner_uid is None or (peer is not None and peer.uid == self.owner_uid)

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


@dataclass(slots=True)
class Sources:
    """What a registration may draw on: allowed shm directories, lent fds, CUDA, and the
    sidecar's own memory (never registrable)."""

    shm_dirs: Sequence[str]
    leases: LeaseRegistry = field(default_factory=LeaseRegistry)
    cuda: Any = None

    @property
    def own_memory(self) -> tuple:
        """(st_dev, st_ino) of the sidecar's memory: what the lease registry refuses too."""
        return self.leases.forbidden


def open_buffer(namespace: str, body: Any, page_bytes: int, src: Sources,
                peer: Optional[Peer]) -> Buffer:
    """Validate a registration body from `peer` (None: TCP) and map the engine's memory."""
    if not isinstance(body, dict):
        raise BadRequest("buffer registration must be a JSON object")
    transport = body.get("transport")
    if transport not in TRANSPORTS:
        raise BadRequest(f"'transport' must be one of {list(TRANSPORTS)}")
    size = _nonneg_int(body.get("size"), "'size'", 1)
    slots = _nonneg_int(body.get("slots"), "'slots'", 1)
    owner = peer.uid if peer is not None else None
    buf_id = "b-" + secrets.token_hex(8)
    if transport == "cuda_ipc":
        pid = _nonneg_int(body["pid"], "'pid'", 1) if body.get("pid") is not None else None
        regions = cuda_ipc.parse_regions(body, size)
        chunks = parse_chunks(body.get("chunks"), page_bytes, [r[3] for r in regions], slots)
        mapping = cuda_ipc.open_buffer(body, src.cuda, pid, size)
        return _owned(Buffer(buf_id, namespace, transport, size, slots, chunks, mapping,
                             pid, owner_uid=owner))
    chunks = parse_chunks(body.get("chunks"), page_bytes, size, slots)
    if peer is None:
        raise Forbidden("shared memory can be registered only on the engine socket "
                        "(--socket), where the sidecar knows who is asking")
    fd, lease, pid = _shm_fd(body, src, peer)
    mapping = ShmMapping(fd, size, src.own_memory)
    return _owned(Buffer(buf_id, namespace, transport, size, slots, chunks, mapping, pid,
                         owner_uid=owner, lease=lease))


def _shm_fd(body: dict, src: Sources, peer: Peer) -> tuple[int, Optional[str], Optional[int]]:
    """(fd, lease id, pid to watch) for an shm registration by `peer`."""
    if "fd" in body or "pid" in body:
        raise BadRequest("'pid' + 'fd' registration is gone: lend the fd on the fd socket "
                         "(SCM_RIGHTS) and register its 'lease' (docs/security.md)")
    if body.get("lease") is not None:
        lease, fd = src.leases.dup(body["lease"], peer)
        return fd, lease.id, None
    if body.get("path") is None:
        raise BadRequest("an shm buffer needs a 'lease' (an fd lent on the fd socket) or a 'path'")
    fd = open_beneath(body["path"], src.shm_dirs)
    owner = os.fstat(fd).st_uid
    if owner != peer.uid:  # root too: a connection may outlive its opener's privileges
        os.close(fd)
        raise Forbidden("the file at 'path' belongs to another user")
    return fd, None, (peer.pid or None)


def _owned(buf: Buffer) -> Buffer:
    """Record the start time of the process whose exit releases `buf`."""
    if buf.pid is not None:
        buf.pid_start = process_start(buf.pid)
        if buf.pid_start is None:
            buf.mapping.close()
            raise BadRequest(f"process {buf.pid} is not running")
    return buf
