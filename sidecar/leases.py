"""Memory lent by engines: file descriptors passed with SCM_RIGHTS on the fd socket.

Holding a descriptor is the proof of possession: an engine can lend only memory it has
open, and the kernel tells the sidecar who lent it (SO_PEERCRED). One SOCK_SEQPACKET
message is one frame:

    engine                                         sidecar, <socket>.fds
    connect ---------------------------------------> accept, SO_PEERCRED -> Peer
    "LEND\\n" + SCM_RIGHTS [fd] ----------------------> exactly one fd: a regular file on tmpfs
    <------- {"lease": "l-<32 hex>", "size": n}\\n     or hugetlbfs (a memfd, /dev/shm), or
                                                      {"error": {"code", "message"}}
    POST /v1/namespaces/{ns}/buffers  {"transport": "shm", "lease": "l-...", ...}
        (on the HTTP socket, by a peer with the lender's uid)
    close, or the engine exits ---------------------> its leases end; their buffers go

A received fd can block whatever touches it (a TCP socket with SO_LINGER blocks its close,
a FUSE file its fstat, a memfd's inode lock its sealing), and so can closing a connection
with fds still queued on it. So the loop only watches readiness and keeps the books: each
frame is received and checked (recvmsg, fstat, fcntl, fstatfs), and every received or lent
fd and every connection is closed, on the lender's lane of the fd threads
(`sidecar.lanes`). A connection's frames are handled in order, one at a time. Caps:
connections, and leases, per uid and in all; a connection holding no lease that sends
nothing for `idle_timeout` seconds is closed (one holding leases stays: they are its
engine's memory).
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import os
import secrets
import socket
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson

from sidecar.errors import Forbidden, LeaseNotFound, TooMany
from sidecar.lanes import Job, Lanes, close_later
from sidecar.peer import Peer, peer_of, unlink_if_ours
from sidecar.transports.shm import HUGETLBFS_MAGIC, TMPFS_MAGIC, fs_type

log = logging.getLogger("kv_sidecar.leases")
FRAME = b"LEND\n"
MAX_CONNECTIONS = 1024  # fd socket connections in all (each holds an fd)
MAX_CONNECTIONS_PER_UID = 64  # and of one uid: the others keep room
MAX_LEASES_PER_CONNECTION = 1024
MAX_LEASES_PER_UID = 256  # each holds an fd: one user cannot take them all
MAX_LEASES = 2048
IDLE_TIMEOUT = 5.0  # s a connection holding no lease may send nothing (--lend-idle-timeout)
FD_DEADLINE = 5.0  # s a frame's check or a registration may take (then 409 / an error)
FD_THREADS = 4  # threads for fd work, one job of a uid at a time
MAX_BACKLOG = 64  # a uid's fd jobs waiting before its frames wait too
ACCEPT_PAUSE = 1.0  # seconds without accepting after EMFILE
O_PATH = getattr(os, "O_PATH", 0o10000000)
LENDABLE_FS = (TMPFS_MAGIC, HUGETLBFS_MAGIC)
_FD_ROOM = socket.CMSG_SPACE(4 * array.array("i").itemsize)  # room to see (and close) extras


def fd_socket_path(http_socket: str) -> str:
    """Where the fd socket lives beside the HTTP socket."""
    return http_socket + ".fds"


@dataclass(slots=True, eq=False)
class Lease:
    id: str
    fd: int
    peer: Peer
    size: int


@dataclass(slots=True, eq=False)
class _Conn:
    sock: socket.socket
    peer: Peer | None
    leases: list[Lease] = field(default_factory=list)
    busy: bool = False  # a frame is being received or checked on an fd thread
    answered: bool = False  # that frame was answered already (it overran FD_DEADLINE)
    timer: Any = None  # the idle timer, or the frame's deadline while busy

    @property
    def uid(self) -> int | None:
        return self.peer.uid if self.peer is not None else None


class LeaseRegistry:
    """Live leases by id. `on_end(lease_ids)` runs (on the loop) when a lender goes.
    `lanes`: the fd threads, where every lent fd is checked, mapped and closed."""

    def __init__(self, forbidden: tuple = (), lanes: Lanes | None = None):
        self.leases: dict[str, Lease] = {}
        self.per_uid: Counter = Counter()
        self.forbidden = forbidden  # (st_dev, st_ino) of the sidecar's own memory
        self.lanes = lanes or Lanes("kv-fd", FD_THREADS, 1)
        self.on_end: Callable[[list[str]], None] = lambda ids: None

    def lend(self, fd: int, st: os.stat_result, peer: Peer) -> Lease:
        """Take ownership of a checked `fd` as a new lease, or hand it to be closed and raise."""
        try:
            if (st.st_dev, st.st_ino) in self.forbidden:
                raise Forbidden("that memory belongs to the sidecar and cannot be lent")
            if self.per_uid[peer.uid] >= MAX_LEASES_PER_UID or len(self.leases) >= MAX_LEASES:
                raise TooMany(
                    f"at most {MAX_LEASES_PER_UID} leases a user and {MAX_LEASES} in "
                    f"all; close some first"
                )
        except (Forbidden, TooMany):
            close_later(self.lanes, peer.uid, partial(os.close, fd))
            raise
        lease = Lease("l-" + secrets.token_hex(16), fd, peer, st.st_size)
        self.leases[lease.id] = lease
        self.per_uid[peer.uid] += 1
        return lease

    def dup(self, lease_id: object, peer: Peer | None) -> tuple[Lease, int]:
        """A new fd of a live lease for a registration by `peer` (same uid as the lender).
        dup() only takes a reference: it cannot block."""
        lease = self.leases.get(lease_id) if isinstance(lease_id, str) else None
        if lease is None or peer is None or peer.uid != lease.peer.uid:
            raise LeaseNotFound(
                "unknown lease: lend the fd on the fd socket first, from the "
                "same user that registers it"
            )
        try:
            return lease, os.dup(lease.fd)
        except OSError:  # EMFILE: the sidecar is out of descriptors
            raise TooMany("the sidecar has no file descriptor left for another buffer") from None

    def end(self, leases: list[Lease]) -> None:
        for lease in leases:
            if self.leases.pop(lease.id, None) is not None:
                self.per_uid[lease.peer.uid] -= 1
                if not self.per_uid[lease.peer.uid]:
                    del self.per_uid[lease.peer.uid]
            close_later(self.lanes, lease.peer.uid, partial(os.close, lease.fd))
        if leases:
            self.on_end([lease.id for lease in leases])

    def close(self) -> None:
        self.end(list(self.leases.values()))


class LendServer:
    """The fd socket: accepts lenders on the event loop and hands their frames to the fd
    threads (`_receive`), one frame of a connection at a time."""

    def __init__(
        self,
        registry: LeaseRegistry,
        sock: socket.socket,
        path: str,
        idle_timeout: float = IDLE_TIMEOUT,
    ):
        self.registry, self.sock, self.path = registry, sock, path
        self.lanes, self.idle_timeout = registry.lanes, idle_timeout
        self.inode = os.stat(path).st_ino
        self.conns: dict[int, _Conn] = {}
        self.per_uid: Counter = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        self.closed: Counter = Counter()  # connections closed by reason, since the last log line
        self.logged = 0.0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._accept)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop `start` was given; every caller runs after it."""
        assert self._loop is not None, "used before start"
        return self._loop

    def close(self) -> None:
        self.closing = True
        if self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
        for conn in list(self.conns.values()):
            self._drop(conn)
        unlink_if_ours(self.path, self.inode)
        close_later(self.lanes, None, self.sock.close)  # queued connections may hold fds

    def _accept(self) -> None:
        try:
            sock, _ = self.sock.accept()
        except BlockingIOError:
            return
        except OSError as exc:  # EMFILE: the socket stays readable, so pause, never spin
            log.warning(
                "fd socket: cannot accept (%s); pausing for %.0f s", exc.strerror, ACCEPT_PAUSE
            )
            self.loop.remove_reader(self.sock.fileno())
            self.loop.call_later(ACCEPT_PAUSE, self._resume)
            return
        conn = _Conn(sock, peer_of(sock))
        if len(self.conns) >= MAX_CONNECTIONS or self.per_uid[conn.uid] >= MAX_CONNECTIONS_PER_UID:
            close_later(self.lanes, conn.uid, sock.close)  # it may carry frames with fds
            self._note(
                f"over the limit ({MAX_CONNECTIONS_PER_UID} a uid, {MAX_CONNECTIONS} in all)"
            )
            return
        sock.setblocking(False)
        self.conns[sock.fileno()] = conn
        self.per_uid[conn.uid] += 1
        self._listen(conn)

    def _resume(self) -> None:
        if not self.closing:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def _listen(self, conn: _Conn) -> None:
        """Wait for the connection's next frame (idle: closed after `idle_timeout` s unless
        it holds leases)."""
        self.loop.add_reader(conn.sock.fileno(), self._readable, conn)
        if not conn.leases:
            conn.timer = self.loop.call_later(self.idle_timeout, self._idle, conn)

    def _readable(self, conn: _Conn) -> None:
        self.loop.remove_reader(conn.sock.fileno())
        if conn.timer is not None:
            conn.timer.cancel()
        if self.lanes.backlog(conn.uid) >= MAX_BACKLOG:  # its earlier fd work is stuck
            conn.timer = self.loop.call_later(ACCEPT_PAUSE, self._listen, conn)
            return
        conn.busy, conn.answered = True, False
        self.lanes.submit(conn.uid, partial(_receive, conn.sock), partial(self._received, conn))
        conn.timer = self.loop.call_later(FD_DEADLINE, self._overdue, conn)

    def _overdue(self, conn: _Conn) -> None:
        """The frame's check overran: answer it now; what it brings later is closed."""
        conn.answered = True
        self._reply(
            conn,
            _error(
                "busy", f"the lent fd could not be received and checked within {FD_DEADLINE:g} s"
            ),
        )

    def _received(self, conn: _Conn, job: Job) -> None:
        kind, detail, rejected = ("eof", None, []) if job.error is not None else job.result
        live = self.conns.get(conn.sock.fileno()) is conn
        if kind == "fd" and (conn.answered or not live):  # too late, or it went: no lease
            rejected = [*rejected, detail[0]]
        for fd in rejected:
            close_later(self.lanes, conn.uid, partial(os.close, fd))
        if not live:
            return
        if kind == "eof":
            return self._drop(conn)
        if kind != "again" and not conn.answered:
            self._reply(conn, self._answer(conn, kind, detail))
        if self.conns.get(conn.sock.fileno()) is conn:  # the reply may have dropped it
            self._resume_conn(conn)

    def _resume_conn(self, conn: _Conn) -> None:
        conn.busy = False
        if conn.timer is not None:
            conn.timer.cancel()
        self._listen(conn)

    def _answer(self, conn: _Conn, kind: str, detail: Any) -> dict:
        if kind == "bad":
            return _error("bad_request", "a frame is b'LEND\\n' with exactly one fd")
        if kind == "refused":
            return _error(detail.code, detail.message)
        fd, st = detail
        if conn.peer is None or len(conn.leases) >= MAX_LEASES_PER_CONNECTION:
            close_later(self.lanes, conn.uid, partial(os.close, fd))
            return _error(
                "too_many_buffers",
                f"at most {MAX_LEASES_PER_CONNECTION} leases a "
                f"connection (and a peer the kernel names)",
            )
        try:
            lease = self.registry.lend(fd, st, conn.peer)
        except (Forbidden, TooMany) as exc:
            return _error(exc.code, exc.message)
        conn.leases.append(lease)
        return {"lease": lease.id, "size": lease.size}

    def _reply(self, conn: _Conn, answer: dict) -> None:
        try:
            conn.sock.send(orjson.dumps(answer) + b"\n")
        except OSError:  # the lender does not read its answers: it loses its leases
            self._drop(conn)

    def _idle(self, conn: _Conn) -> None:
        if self.conns.get(conn.sock.fileno()) is conn and not conn.busy and not conn.leases:
            self._note(f"idle {self.idle_timeout:g} s with no lease")
            self._drop(conn)

    def _note(self, why: str) -> None:
        """Count a connection the sidecar closed; one log line per 10 s at most."""
        self.closed[why] += 1
        now = self.loop.time()
        if now - self.logged >= 10:
            log.warning(
                "fd socket: closed connections: %s",
                ", ".join(f"{n} {reason}" for reason, n in self.closed.items()),
            )
            self.closed.clear()
            self.logged = now

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if self.conns.get(fd) is not conn:
            return
        del self.conns[fd]
        self.per_uid[conn.uid] -= 1
        if not self.per_uid[conn.uid]:
            del self.per_uid[conn.uid]
        if conn.timer is not None:
            conn.timer.cancel()
        if not conn.busy:
            self.loop.remove_reader(fd)
        # after any frame in flight (its lane runs one job at a time); purging the fds
        # still queued on the connection can block too
        close_later(self.lanes, conn.uid, conn.sock.close)
        self.registry.end(conn.leases)


def _receive(sock: socket.socket) -> tuple[str, Any, list[int]]:
    """On an fd thread: receive one frame and check its fd. (kind, detail, fds to close):
    ("eof" | "again" | "bad", None, ...), ("refused", Forbidden, ...) or ("fd", (fd, stat), [])."""
    try:
        data, anc, flags, _ = sock.recvmsg(64, _FD_ROOM)
    except BlockingIOError:
        return "again", None, []
    except OSError:
        return "eof", None, []
    fds = _fds(anc)
    if not data or data != FRAME or len(fds) != 1 or flags & socket.MSG_CTRUNC:
        return ("bad" if data else "eof"), None, fds
    try:
        return "fd", (fds[0], _check_lendable(fds[0])), []
    except Forbidden as exc:
        return "refused", exc, fds


def _check_lendable(fd: int) -> os.stat_result:
    """A regular file on tmpfs or hugetlbfs (a memfd, a file in /dev/shm), open read-write
    (not O_PATH, not append-only); else Forbidden. Blocks where the fd's file system does:
    called on an fd thread only."""
    try:
        st = os.fstat(fd)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        raise Forbidden("the lent fd cannot be inspected") from None
    if not stat.S_ISREG(st.st_mode):
        raise Forbidden("only a memfd or a shared-memory file can be lent")
    if flags & os.O_ACCMODE != os.O_RDWR or flags & (os.O_APPEND | O_PATH):
        raise Forbidden("a lent fd must be open read-write, not O_APPEND or O_PATH")
    if fs_type(fd) not in LENDABLE_FS:
        raise Forbidden(
            "only memory can be lent: a memfd, or a file on tmpfs or hugetlbfs "
            "(/dev/shm); register other files by 'path' under an allowed directory"
        )
    return st


def _error(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


def _fds(ancillary) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)
