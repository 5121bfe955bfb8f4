"""Who is asking: the kernel's word for the process at the other end of a Unix socket.

A request that arrives on the engine socket carries a `Peer` (pid, uid, gid from
`SO_PEERCRED`, read once when the connection is accepted). A request on TCP has none: the
sidecar cannot tell who sent it, so it maps no memory for it (see `sidecar.buffers`).
"""

from __future__ import annotations

import ctypes
import errno
import grp
import os
import socket
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.datadir import check_private

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
PEER_KEY = "kv.peer"  # where the server puts the Peer in an ASGI scope
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
PY_OPTLEN = 1024  # the most CPython's getsockopt asks for (256 gids; more: `_many_groups`)
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True, slots=True)
class Peer:
    """The credentials of a connected process. `pid` is 0 when that process lives in a
    PID namespace the sidecar cannot see (another container). `groups`: its primary and
    supplementary gids (SO_PEERGROUPS), what a namespace's `share_gid` is checked against."""

    pid: int
    uid: int
    gid: int
    groups: frozenset = frozenset()

    def may_use(self, owner_uid: int | None) -> bool:
        """Whether this peer may use memory registered by `owner_uid` (None: a TCP-registered
        CUDA IPC buffer, where the handle itself is the capability)."""
        return owner_uid is None or self.uid == owner_uid


def peer_of(sock: Any) -> Peer | None:
    """The peer of a connected AF_UNIX socket (or uvloop's socket-like object); None for
    any other socket."""
    try:
        if sock is None or sock.family != socket.AF_UNIX:
            return None
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (OSError, AttributeError):
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid, uid, gid, frozenset((gid, *_groups(sock))))


def _groups(sock: Any) -> tuple[int, ...]:
    """The peer's supplementary gids (SO_PEERGROUPS, Linux 4.13+), as the kernel took them at
    its connect (nothing the peer does later changes them). None on a kernel without it."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, PY_OPTLEN)
    except OSError as exc:
        if exc.errno != errno.ERANGE:
            return ()
        raw = _many_groups(sock.fileno())  # over 256 groups: the size the kernel names
    return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])


def _many_groups(fd: int) -> bytes:
    """SO_PEERGROUPS past CPython's 1,024-byte bound: ask with no room, and the kernel
    answers ERANGE with the length it needs (at most 65,536 gids); ask again with that."""
    size = ctypes.c_uint32(0)
    for _ in range(2):
        buf = ctypes.create_string_buffer(max(size.value, 1))
        if _libc.getsockopt(fd, socket.SOL_SOCKET, SO_PEERGROUPS, buf, ctypes.byref(size)) == 0:
            return buf.raw[: size.value]
        if ctypes.get_errno() != errno.ERANGE:
            break
    return b""


def scope_peer(scope: Mapping[str, Any]) -> Peer | None:
    """The Peer the server attached to an ASGI scope, or None (TCP)."""
    return scope.get(PEER_KEY)


def bind_unix(
    path: str, mode: int, group: str | None = None, kind: int = socket.SOCK_STREAM
) -> socket.socket:
    """A listening Unix socket at `path` with `mode` (and `group`), in a directory nobody
    else controls (`datadir.check_private`). A stale socket file is replaced; a live one
    (another sidecar answers) or any other file is an error."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, 0o755, exist_ok=True)
    why = check_private(directory)
    if why:
        raise RuntimeError(f"the socket directory {directory} is unusable: {why}")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise RuntimeError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, kind)
        try:
            probe.connect(path)
            raise RuntimeError(f"another process is listening on {path}")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, kind)
    old = os.umask(0o177)  # nobody can connect before the chmod below
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    if group is not None:
        os.chown(path, -1, group_id(group))
    os.chmod(path, mode)
    sock.listen(1024)
    return sock


def unlink_if_ours(path: str, inode: int) -> None:
    """Remove a socket file at exit, unless another process has bound the path since."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


def group_id(group: str) -> int:
    """A group name or number -> gid."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"no such group: {group!r}") from None
