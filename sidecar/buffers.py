"""Registered engine buffers: geometry, owner, in-flight reference counts.

Who may register what (the trust rule of docs/security.md):

    transport  form            where             proof
    shm        "lease"         engine socket     the fd itself, lent with SCM_RIGHTS
    shm        "path"          engine socket     O_NOFOLLOW walk + file owner == peer uid
    cuda_ipc   "handle"        socket or TCP     the IPC handle (a capability; token on TCP)

A buffer registered on the engine socket is usable only by peers with the registering uid.
Every syscall on an shm buffer's fd (the walk, fstat, sealing, mmap, munmap, close) runs on
its owner's lane of the fd threads (`sidecar.lanes`), never on the event loop; what one
uid holds (buffers, mapped bytes) is counted in `Quota`.
"""

from __future__ import annotations

import os
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sidecar import leases as lending
from sidecar.errors import BadRequest, Conflict, Forbidden, TooMany
from sidecar.lanes import Job, Lanes, close_later
from sidecar.leases import LeaseRegistry
from sidecar.peer import Peer
from sidecar.transports import cuda_ipc
from sidecar.transports.base import Chunk, _nonneg_int, covered, parse_chunks
from sidecar.transports.shm import ShmMapping, open_beneath

TRANSPORTS = ("shm", "cuda_ipc")
MAX_MAPPED = 64 << 40  # bytes of engine memory mapped at once, every uid (--max-mapped)
MAX_MAPPED_PER_UID = 16 << 40  # and by one uid's buffers (--max-mapped-per-uid)


def process_start(pid: int) -> str | None:
    """The start time of `pid` from /proc (guards against pid reuse); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().rsplit(b")", 1)[1].split()
        return stat[19].decode()
    except (OSError, IndexError):
        return None


@dataclass(slots=True)
class Quota:
    """Buffers and mapped bytes held per owner (a uid; None: TCP) and in all, from the
    registration's start until its mapping is handed to be closed."""

    max_mapped: int = MAX_MAPPED
    max_mapped_per_uid: int = MAX_MAPPED_PER_UID
    buffers: Counter = field(default_factory=Counter)
    mapped: Counter = field(default_factory=Counter)
    total_buffers: int = 0
    total_mapped: int = 0

    def take(self, owner: int | None, buffers: int, mapped: int) -> None:
        """Count a buffer (or only more mapped bytes); 429 past a mapped-bytes bound."""
        if mapped and (
            self.total_mapped + mapped > self.max_mapped
            or self.mapped[owner] + mapped > self.max_mapped_per_uid
        ):
            raise TooMany(
                f"mapping {mapped} more bytes would pass the sidecar's bound on mapped "
                f"engine memory ({self.max_mapped_per_uid} bytes a user, "
                f"{self.max_mapped} in all): release buffers, or register smaller ones"
            )
        self.buffers[owner] += buffers
        self.mapped[owner] += mapped
        self.total_buffers += buffers
        self.total_mapped += mapped

    def give(self, owner: int | None, buffers: int, mapped: int) -> None:
        self.buffers[owner] -= buffers
        self.mapped[owner] -= mapped
        self.total_buffers -= buffers
        self.total_mapped -= mapped
        assert self.buffers[owner] >= 0 and self.mapped[owner] >= 0, "quota given back twice"
        if not self.buffers[owner]:
            del self.buffers[owner], self.mapped[owner]


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
    pid: int | None = None  # released when this process exits (polled)
    pid_start: str | None = None
    owner_uid: int | None = None  # None: registered on TCP (cuda_ipc only)
    lease: str | None = None  # released when this lease ends
    refs: int = 0
    released: bool = False
    bad: str | None = None  # why moves with it answer false at once (a stuck copy)
    quota: Quota | None = None  # where it is counted (given back when it closes)
    mapped: int = 0  # bytes of address space its mapping holds
    lanes: Lanes | None = None  # where its mapping is closed (None: right here)

    def describe(self) -> dict[str, Any]:
        return {
            "buffer_id": self.id,
            "transport": self.transport,
            "size": self.size,
            "slots": self.slots,
            "pid": self.pid,
            "owner_uid": self.owner_uid,
            "mode": "mmap" if getattr(self.mapping, "sealed", True) else "fd",
            "mapped": self.mapped,
            "bad": self.bad,
            "chunks": [
                {"offset": c.offset, "stride": c.stride, "size": c.size} for c in self.chunks
            ],
        }

    def usable_by(self, peer: Peer | None) -> bool:
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
            self._close()

    def release(self) -> None:
        """Unregister; the mapping closes once the last in-flight copy ends."""
        if not self.released:
            self.released = True
            if self.refs == 0:
                self._close()

    def _close(self) -> None:
        """Hand the mapping to be closed (munmap, close: off the loop) and uncount it."""
        if self.quota is not None:
            self.quota.give(self.owner_uid, 1, self.mapped)
            self.quota = None
        close_later(self.lanes, self.owner_uid, self.mapping.close)


@dataclass(slots=True)
class Sources:
    """What a registration may draw on: allowed shm directories, lent fds (and the fd
    threads), CUDA, the sidecar's own memory (never registrable), and what each uid holds."""

    shm_dirs: Sequence[str]
    leases: LeaseRegistry = field(default_factory=LeaseRegistry)
    cuda: Any = None
    quota: Quota = field(default_factory=Quota)

    @property
    def own_memory(self) -> tuple:
        """(st_dev, st_ino) of the sidecar's memory: what the lease registry refuses too."""
        return self.leases.forbidden


async def open_buffer(
    namespace: str, body: Any, page_bytes: int, src: Sources, peer: Peer | None
) -> Buffer:
    """Validate a registration body from `peer` (None: TCP) and map the engine's memory.
    The buffer is counted in `src.quota` before the first await (the caller's caps, checked
    just before, hold under concurrent registrations)."""
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
        src.quota.take(owner, 1, 0)
        return _owned(
            Buffer(
                buf_id,
                namespace,
                transport,
                size,
                slots,
                chunks,
                mapping,
                pid,
                owner_uid=owner,
                quota=src.quota,
            )
        )
    chunks = parse_chunks(body.get("chunks"), page_bytes, size, slots)
    if peer is None:
        raise Forbidden(
            "shared memory can be registered only on the engine socket "
            "(--socket), where the sidecar knows who is asking"
        )
    if src.leases.lanes.backlog(owner) >= lending.MAX_BACKLOG:
        raise TooMany("this user's earlier registrations or closes are still running; try again")
    span = covered(chunks, slots)
    reserved, refusal = _reserve(src.quota, owner, span[1] - span[0])
    try:
        open_fd, lease, pid = _shm_fd(body, src, peer)
        mapping = await _map_off_loop(
            src,
            owner,
            open_fd,
            partial(ShmMapping, size=size, forbidden=src.own_memory, span=span, refusal=refusal),
        )
    except BaseException:
        src.quota.give(owner, 1, reserved)
        raise
    src.quota.give(owner, 0, reserved - mapping.mapped)  # fd mode maps nothing
    return _owned(
        Buffer(
            buf_id,
            namespace,
            transport,
            size,
            slots,
            chunks,
            mapping,
            pid,
            owner_uid=owner,
            lease=lease,
            quota=src.quota,
            mapped=mapping.mapped,
            lanes=src.leases.lanes,
        )
    )


def _reserve(quota: Quota, owner: int | None, span: int) -> tuple[int, TooMany | None]:
    """Count a buffer and reserve `span` mapped bytes: (reserved, None); past a bound
    (0, the 429), which the mapping raises only if it would map (fd mode maps nothing)."""
    try:
        quota.take(owner, 1, span)
        return span, None
    except TooMany as exc:
        quota.take(owner, 1, 0)
        return 0, exc


def _shm_fd(
    body: dict, src: Sources, peer: Peer
) -> tuple[Callable[[], int], str | None, int | None]:
    """(a call giving the fd, on the fd thread; lease id; pid to watch) for an shm
    registration by `peer`. A lease's fd is duplicated here (dup cannot block)."""
    if "fd" in body or "pid" in body:
        raise BadRequest(
            "'pid' + 'fd' registration is gone: lend the fd on the fd socket "
            "(SCM_RIGHTS) and register its 'lease' (docs/security.md)"
        )
    if body.get("lease") is not None:
        lease, fd = src.leases.dup(body["lease"], peer)
        return _Lent(fd), lease.id, None
    if body.get("path") is None:
        raise BadRequest("an shm buffer needs a 'lease' (an fd lent on the fd socket) or a 'path'")
    return partial(_open_owned, body["path"], src.shm_dirs, peer.uid), None, (peer.pid or None)


@dataclass(slots=True)
class _Lent:
    """A dup of a lent fd, owned by the registration until its mapping takes it."""

    fd: int

    def __call__(self) -> int:
        return self.fd


def _open_owned(path: object, allowed: Sequence[str], uid: int) -> int:
    """Open `path` beneath an allowed directory (on an fd thread); 403 unless `uid` owns it."""
    fd = open_beneath(path, allowed)
    if os.fstat(fd).st_uid != uid:  # root too: a connection may outlive its opener's privileges
        os.close(fd)
        raise Forbidden("the file at 'path' belongs to another user")
    return fd


async def _map_off_loop(
    src: Sources,
    owner: int | None,
    open_fd: Callable[[], int],
    mapping: Callable[[int], ShmMapping],
) -> ShmMapping:
    """`mapping(open_fd())` on `owner`'s fd lane, within FD_DEADLINE seconds (409 after:
    the memory stayed locked; what the late job makes is closed when it ends)."""
    lanes, deadline = src.leases.lanes, lending.FD_DEADLINE
    job = await lanes.call(
        owner, lambda: mapping(open_fd()), deadline, partial(_late_mapping, lanes, open_fd)
    )
    if job is None:
        raise Conflict(
            f"registering took longer than {deadline:g} s: the memory is locked "
            f"by another operation (or this user's earlier ones are stuck); try again"
        )
    if job.error is not None:
        raise job.error
    return job.result


def _late_mapping(lanes: Lanes, open_fd: Callable[[], int], job: Job) -> None:
    """A registration that answered 409 ended: close what it made (or the fd it never used)."""
    if job.state == "dropped":
        if isinstance(open_fd, _Lent):
            close_later(lanes, job.owner, partial(os.close, open_fd.fd))
    elif job.error is None:
        close_later(lanes, job.owner, job.result.close)


def _owned(buf: Buffer) -> Buffer:
    """Record the start time of the process whose exit releases `buf`."""
    if buf.pid is not None:
        buf.pid_start = process_start(buf.pid)
        if buf.pid_start is None:
            buf.release()
            raise BadRequest(f"process {buf.pid} is not running")
    return buf
