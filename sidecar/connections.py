"""Who may hold a connection, and for how long (issue 26, items 2, 3, 6 and 10).

    listener        cap                                    before a valid token (TCP, token set)
    loopback TCP    --max-connections                      --auth-timeout idle or head, then
                                                           closed; the least recently active
                                                           one is closed to admit a new one
                                                           when TCP is full; closed after 401
    engine socket   --max-connections, and per peer uid    (the socket's mode and group)
                    --max-connections-per-uid

The two listeners are counted apart: whatever TCP holds, the engine socket keeps serving its
group. The server's protocol (`sidecar.server`) asks `Registry.admit` on every accepted
connection and enforces the per-request limits (head size, header fields, body deadline,
write timeout) itself; this module keeps the counts and the reasons.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from typing import Any

from sidecar.config import Config

log = logging.getLogger("kv_sidecar")

TCP, ENGINE = "tcp", "engine"
CONN_KEY = "kv.conn"  # scope key: the connection, while it still has to show the token
CLOSING_KEY = "kv.closing"  # scope key: a callable, true once the connection is going away
SO_PASSRIGHTS = 83  # Linux 6.16+ (x86-64 and asm-generic); not in Python's socket module
LOG_PERIOD = 10.0  # seconds between two log lines about refused or closed connections


def refuse_fd_passing(sock: socket.socket) -> bool:
    """Make the kernel refuse SCM_RIGHTS sent to `sock` (and the connections it accepts): a
    sender's sendmsg fails with EPERM, so the sidecar never receives, and never closes on its
    event loop, an fd it did not ask for. False (and one warning) where the kernel lacks it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
        return True
    except OSError as exc:
        log.warning(
            "the kernel cannot refuse fds sent to the engine socket (SO_PASSRIGHTS: %s): "
            "a peer in the socket group can make the event loop close an fd it attached",
            exc.strerror,
        )
        return False


class Tally:
    """Counts of refused and closed connections by reason, logged as one line a period at
    most: a storm of connections must not become a storm of log lines (a stderr nobody reads
    fills its pipe and blocks the loop)."""

    def __init__(self, period: float = LOG_PERIOD):
        self.counts: Counter = Counter()
        self._logged: Counter = Counter()
        self._period = period
        self._next = 0.0

    def note(self, reason: str) -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self._period
            fresh = self.counts - self._logged
            self._logged = self.counts.copy()
            log.warning(
                "connections refused or closed since the last line: %s",
                ", ".join(f"{n} {why}" for why, n in sorted(fresh.items())),
            )


class Registry:
    """Open connections per listener and per engine-socket uid; TCP connections that have not
    shown the token, least recently active first. Runs on the event loop only."""

    def __init__(self, config: Config):
        self.cap = config.max_connections
        self.per_uid = min(config.max_connections_per_uid, config.max_connections)
        self.open = {TCP: 0, ENGINE: 0}
        self.by_uid: Counter = Counter()
        self.unauthenticated: dict[Any, None] = {}  # insertion order: least recently active first
        self.tally = Tally()

    def admit(self, conn: Any, listener: str, uid: int | None, pending: bool) -> str | None:
        """None when `conn` may stay (counted until `release`); else why it is refused.
        `pending`: a TCP connection that still has to show the token."""
        if self.open[listener] >= self.cap and not (listener == TCP and self._evict()):
            return f"{listener}_full"
        if listener == ENGINE:
            if self.by_uid[uid] >= self.per_uid:
                return "uid_full"
            self.by_uid[uid] += 1
        self.open[listener] += 1
        if pending:
            self.unauthenticated[conn] = None
        return None

    def release(self, conn: Any, listener: str, uid: int | None) -> None:
        self.open[listener] -= 1
        if listener == ENGINE:
            self.by_uid[uid] -= 1
            if not self.by_uid[uid]:
                del self.by_uid[uid]
        self.unauthenticated.pop(conn, None)

    def touch(self, conn: Any) -> None:
        """`conn` (not yet authenticated) began a request: now the most recently active."""
        self.unauthenticated.pop(conn, None)
        self.unauthenticated[conn] = None

    def authenticated(self, conn: Any) -> None:
        self.unauthenticated.pop(conn, None)

    def _evict(self) -> bool:
        """Close the least recently active TCP connection that has not shown the token, so
        that TCP being full of them never locks the operator out. False: none to close."""
        if not self.unauthenticated:
            return False
        victim = next(iter(self.unauthenticated))
        victim.evict()  # released here: its connection_lost will not count it again
        self.release(victim, TCP, None)
        self.tally.note("tcp_evicted")
        return True
