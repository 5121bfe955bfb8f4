"""Memory lent by engines: file descriptors passed with SCM_RIGHTS on the fd socket.

Holding a descriptor is the proof of possession: an engine can lend only memory it has
open, and the kernel tells the sidecar who lent it (SO_PEERCRED). One SOCK_SEQPACKET
message is one frame:

    engine                                         sidecar, <socket>.fds
    connect ---------------------------------------> accept, SO_PEERCRED -> Peer
    "LEND\\n" + SCM_RIGHTS [fd] ----------------------> exactly one fd, a regular file
    <------- {"lease": "l-<32 hex>", "size": n}\\n     (or {"error": {"code", "message"}})
    POST /v1/namespaces/{ns}/buffers  {"transport": "shm", "lease": "l-...", ...}
        (on the HTTP socket, by a peer with the lender's uid)
    close, or the engine exits ---------------------> its leases end; their buffers go

Frames are handled on the event loop by readiness callbacks (a frame is one short
recvmsg); connections and leases per connection are capped.
"""
from __future__ import annotations

import array
import fcntl
import logging
import os
import secrets
import socket
import stat
from dataclasses import dataclass, field
from typing import Callable, Optional

import orjson

from sidecar.errors import Forbidden, LeaseNotFound, TooMany
from sidecar.peer import Peer, peer_of, unlink_if_ours

log = logging.getLogger("kv_sidecar.leases")
FRAME = b"LEND\n"
MAX_CONNECTIONS = 256
MAX_LEASES_PER_CONNECTION = 1024
ACCEPT_PAUSE = 1.0            # seconds without accepting after EMFILE
MAX_LEASES_PER_UID = 1024      # each holds an fd: one user cannot take them all
O_PATH = getattr(os, "O_PATH", 0o10000000)
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
    peer: Optional[Peer]
    leases: list[Lease] = field(default_factory=list)


class LeaseRegistry:
    """Live leases by id. `on_end(lease_ids)` runs (on the loop) when a lender goes."""

    def __init__(self, forbidden: tuple = ()):
        self.leases: dict[str, Lease] = {}
        self.forbidden = forbidden           # (st_dev, st_ino) of the sidecar's own memory
        self.on_end: Callable[[list[str]], None] = lambda ids: None

    def lend(self, fd: int, peer: Peer) -> Lease:
        """Take ownership of `fd` as a new lease, or close it and raise."""
        try:
            st = _check_lendable(fd)
            if (st.st_dev, st.st_ino) in self.forbidden:
                raise Forbidden("that memory belongs to the sidecar and cannot be lent")
            if sum(1 for x in self.leases.values() if x.peer.uid == peer.uid) >= MAX_LEASES_PER_UID:
                raise TooMany(f"at most {MAX_LEASES_PER_UID} leases a user; close some first")
        except BaseException:
            os.close(fd)
            raise
        lease = Lease("l-" + secrets.token_hex(16), fd, peer, st.st_size)
        self.leases[lease.id] = lease
        return lease

    def dup(self, lease_id: object, peer: Optional[Peer]) -> tuple[Lease, int]:
        """A new fd of a live lease for a registration by `peer` (same uid as the lender)."""
        lease = self.leases.get(lease_id) if isinstance(lease_id, str) else None
        if lease is None or peer is None or peer.uid != lease.peer.uid:
            raise LeaseNotFound("unknown lease: lend the fd on the fd socket first, from the "
                                "same user that registers it")
        try:
            return lease, os.dup(lease.fd)
        except OSError:  # EMFILE: the sidecar is out of descriptors
            raise TooMany("the sidecar has no file descriptor left for another buffer") from None

    def end(self, leases: list[Lease]) -> None:
        for lease in leases:
            self.leases.pop(lease.id, None)
            os.close(lease.fd)
        if leases:
            self.on_end([lease.id for lease in leases])

    def close(self) -> None:
        self.end(list(self.leases.values()))


class LendServer:
    """The fd socket: accepts lenders and answers their frames, on the event loop."""

    def __init__(self, registry: LeaseRegistry, sock: socket.socket, path: str):
        self.registry, self.sock, self.path = registry, sock, path
        self.inode = os.stat(path).st_ino
        self.conns: dict[int, _Conn] = {}
        self.loop = None

    def start(self, loop) -> None:
        self.loop = loop
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if self.loop is not None:
            self.loop.remove_reader(self.sock.fileno())
        for conn in list(self.conns.values()):
            self._drop(conn)
        self.sock.close()
        unlink_if_ours(self.path, self.inode)

    def _accept(self) -> None:
        try:
            sock, _ = self.sock.accept()
        except BlockingIOError:
            return
        except OSError as exc:  # EMFILE: the socket stays readable, so pause, never spin
            log.warning("fd socket: cannot accept (%s); pausing for %.0f s", exc.strerror, ACCEPT_PAUSE)
            self.loop.remove_reader(self.sock.fileno())
            self.loop.call_later(ACCEPT_PAUSE, self._resume)
            return
        if len(self.conns) >= MAX_CONNECTIONS:
            sock.close()
            log.warning("fd socket: refused a connection over the limit of %d", MAX_CONNECTIONS)
            return
        sock.setblocking(False)
        conn = _Conn(sock, peer_of(sock))
        self.conns[sock.fileno()] = conn
        self.loop.add_reader(sock.fileno(), self._readable, conn)

    def _resume(self) -> None:
        if self.sock.fileno() >= 0:  # not closed meanwhile
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def _readable(self, conn: _Conn) -> None:
        try:
            data, anc, flags, _ = conn.sock.recvmsg(64, _FD_ROOM)
        except BlockingIOError:
            return
        except OSError:
            return self._drop(conn)
        fds = _fds(anc)
        if not data:
            for fd in fds:
                os.close(fd)
            return self._drop(conn)
        self._reply(conn, self._frame(conn, data, fds, flags))

    def _frame(self, conn: _Conn, data: bytes, fds: list[int], flags: int) -> dict:
        if data != FRAME or len(fds) != 1 or flags & socket.MSG_CTRUNC or conn.peer is None \
                or len(conn.leases) >= MAX_LEASES_PER_CONNECTION:
            for fd in fds:
                os.close(fd)
            return {"error": {"code": "bad_request", "message": "a frame is b'LEND\\n' with "
                              f"exactly one fd (at most {MAX_LEASES_PER_CONNECTION} a connection)"}}
        try:
            lease = self.registry.lend(fds[0], conn.peer)
        except (Forbidden, TooMany) as exc:
            return {"error": {"code": exc.code, "message": exc.message}}
        conn.leases.append(lease)
        return {"lease": lease.id, "size": lease.size}

    def _reply(self, conn: _Conn, answer: dict) -> None:
        try:
            conn.sock.send(orjson.dumps(answer) + b"\n")
        except OSError:  # the lender does not read its answers: it loses its leases
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if self.conns.pop(fd, None) is None:
            return
        self.loop.remove_reader(fd)
        conn.sock.close()
        self.registry.end(conn.leases)


def _check_lendable(fd: int) -> os.stat_result:
    """A regular file open read-write (not O_PATH, not append-only); else Forbidden."""
    try:
        st = os.fstat(fd)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        raise Forbidden("the lent fd cannot be inspected") from None
    if not stat.S_ISREG(st.st_mode):
        raise Forbidden("only a memfd or a shared-memory file can be lent")
    if flags & os.O_ACCMODE != os.O_RDWR or flags & (os.O_APPEND | O_PATH):
        raise Forbidden("a lent fd must be open read-write, not O_APPEND or O_PATH")
    return st


def _fds(ancillary) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)
