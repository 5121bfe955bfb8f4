"""What a hostile neighbour hands the sidecar, shared by the red-team runners
(loadtest/redteam/*.py) and the regression tests that force the same cases."""

from __future__ import annotations

import socket
import struct


def lingering_tcp(linger_s: int = 60) -> tuple[socket.socket, socket.socket]:
    """(listener, client): a connected TCP client whose send queue is full of bytes nobody
    will read, with SO_LINGER `linger_s`: closing its last reference blocks that long (or
    until the listener goes). Small buffers make the queue fill at once."""
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)  # never accepted: the data stays unread
    cli = socket.socket()
    cli.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    cli.connect(lst.getsockname())
    cli.setblocking(False)
    try:
        while True:
            cli.send(b"x" * 65536)
    except BlockingIOError:
        pass
    cli.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger_s))
    return lst, cli
