"""The sockets of KV events (sidecar/events.py collects and encodes them): the PUB that
sends every batch, the replay ring, and the thread that serves replays from it.

    loop:           send(topic, payload) -> PUB  [topic, seq, payload]   (never blocks)
                                        -> ring (the newest batches, replay_ring.py)
    replay thread:  ROUTER [id, b"", seq] -> [id, b"", topic, seq, payload] for each kept
                    batch from seq on, then [id, b"", b"", -1, b""]

What a subscriber or replay client that does not read can cost the sidecar (a router
may hang with its connection open), bounded:

- PUB: ZMQ queues each subscriber's batches until its high-water mark (`hwm` batches),
  then drops them for that subscriber (it sees the gap in `seq` and replays). The queued
  batches are shared by every subscriber behind (ZMQ counts references), so memory is at
  most `hwm` batches however many there are; a batch is bounded in bytes (events.py
  splits them), and `hwm` is set from a byte budget (`events.queue_hwm`). vLLM's publisher keeps 100,000: tens of GB
  of this sidecar's batches for one subscriber that stopped (docs/kv-events.md, Limits).
- ROUTER: a replay is copied out of the ring batch by batch, `replay_hwm` batches queued
  to its client at most, one replay at a time, at `rate` bytes a second at most (the
  thread's copies take the GIL from the event loop). A client that keeps the thread
  waiting `stall` seconds in all is given up (counted): one that reads slowly holds it no
  longer than one that reads nothing. What was queued to a client given up stays queued
  until it disconnects: `replay_hwm` batches.

Not bounded: what a process that speaks ZMTP itself can send (a message whose parts
never end is kept whole). So the endpoints are for routers the operator trusts: an
`ipc://` endpoint is a Unix socket made by `unix` (`--kv-events-mode`, `--kv-events-group`:
not the engine socket's), which other users cannot connect to; loopback TCP is open to
every user.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar.peer import unlink_if_ours
from sidecar.replay_ring import ReplayRing

if TYPE_CHECKING:  # the `events` extra
    import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_SUBSCRIPTION = 4096  # bytes of a subscription message (a topic prefix) at most


@dataclass(frozen=True, slots=True)
class Limits:
    """What one subscriber or replay client may hold of the sidecar (module docstring)."""

    hwm: int = 1000  # batches queued to one subscriber, then dropped for it
    replay_hwm: int = 16  # batches queued to one replay client, then wait for it
    stall: float = 5.0  # s a replay waits for its client in all, then gives up
    rate: float = 128 * 2**20  # bytes a second a replay sends at most


class Publisher:
    """The PUB socket (sent on the event loop: a PUB never blocks, it drops past its
    high-water mark, and ZMQ's own I/O thread does the sending), the replay ring, and
    the replay thread that owns the ROUTER socket and reads the ring."""

    def __init__(
        self,
        endpoint: str,
        replay: str | None,
        keep: int,
        keep_bytes: int,
        limits: Limits = Limits(),
        unix: Callable | None = None,
    ):
        """`unix(path)`: the listening Unix socket an `ipc://` endpoint gets (its mode and
        group: `peer.bind_unix`, as the engine socket's); None: ZMQ makes it (umask)."""
        import zmq  # the `events` extra: imported only when events are on

        self.zmq, self.limits, self.unix = zmq, limits, unix
        self.ctx: zmq.Context = zmq.Context.instance()
        self.files: list[tuple[str, int]] = []  # the ipc:// socket files made here
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(limits.hwm)
        self.pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION)  # what a subscriber sends
        self._bind(self.pub, endpoint)
        self.ring = ReplayRing(keep, keep_bytes)
        self.seq = 0
        self.replays = self.replays_given_up = 0
        self.router: zmq.Socket | None = None
        self.thread: threading.Thread | None = None
        self.running = True
        if replay:
            self.router = self._router(replay)
            self.thread = threading.Thread(
                target=self._serve_replay, name="kv-events-replay", daemon=True
            )
            self.thread.start()

    @property
    def replies(self) -> zmq.Socket:
        """The ROUTER: made with the replay thread, its one user (and `close`'s after it)."""
        assert self.router is not None, "a replay without a replay endpoint"
        return self.router

    def _router(self, endpoint: str):
        zmq, limits = self.zmq, self.limits
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.SNDHWM, limits.replay_hwm)
        router.setsockopt(zmq.MAXMSGSIZE, 64)  # a request is 8 bytes
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue or a gone client: an error
        self._bind(router, endpoint)
        return router

    def _bind(self, sock, endpoint: str) -> None:
        """An `ipc://PATH` endpoint on the Unix socket `unix(PATH)` makes (ZMQ takes its fd
        and closes it); any other as ZMQ binds it."""
        if not (endpoint.startswith("ipc://") and self.unix is not None):
            sock.bind(endpoint)
            return
        path = endpoint[len("ipc://") :]
        listener = self.unix(path)
        inode = os.stat(path).st_ino
        try:
            sock.setsockopt(self.zmq.USE_FD, listener.fileno())
            sock.bind(endpoint)
        except BaseException:  # not ZMQ's: ours to close and remove
            listener.close()
            unlink_if_ours(path, inode)
            raise
        listener.detach()  # ZMQ's now: it closes it
        self.files.append((path, inode))

    def send(self, topic: bytes, payload) -> bool:
        """Publish one batch now (on the loop); False when ZMQ refused it (counted).
        `payload` (bytes-like) is copied by both ZMQ and the ring: the caller may reuse it."""
        try:
            self.pub.send_multipart(
                (topic, self.seq.to_bytes(8, "big"), payload), flags=self.zmq.NOBLOCK
            )  # copied: at 20 ms batches as cheap
            # as zero-copy, with no gc thread
        except self.zmq.ZMQError:
            return False
        self.ring.add(self.seq, topic, payload)
        self.seq += 1
        return True

    def _serve_replay(self) -> None:
        while self.running:
            if self.replies.poll(100):
                self._replay()

    def _replay(self) -> None:
        """One request: every kept batch from its seq on, paced, then the end marker;
        given up (counted) when the client is gone or kept the thread waiting `stall`
        seconds in all (one that reads slowly holds it no longer than one that reads
        nothing: ZMQ frees queue slots in steps, so no single wait need be long)."""
        frames = self.replies.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        client, _, start = frames
        self.replays += 1
        kept = (
            (topic, seq.to_bytes(8, "big"), payload)
            for seq, topic, payload in self.ring.since(int.from_bytes(start, "big"))
        )
        due, left = time.monotonic(), self.limits.stall
        for reply in itertools.chain(kept, [(b"", END_SEQ, b"")]):
            rest = self._reply(client, reply, left)
            if rest is None:
                self.replays_given_up += 1
                return
            left = rest
            due += len(reply[2]) / self.limits.rate
            time.sleep(max(0.0, due - time.monotonic()))  # (and the GIL to the loop)

    def _reply(self, client: bytes, frames: tuple, left: float) -> float | None:
        """One message to `client`, waiting while its queue is full, `left` seconds at
        most: what is left of them, or None once it is gone, or they ran out, or the
        publisher closes."""
        t = time.monotonic()
        while self.running:
            try:
                self.replies.send_multipart((client, b"", *frames), flags=self.zmq.NOBLOCK)
                return left - (time.monotonic() - t)
            except self.zmq.Again:  # its queue is full: it has not read
                if time.monotonic() - t > left:
                    return None
                time.sleep(0.005)
            except self.zmq.ZMQError:  # EHOSTUNREACH: gone (or never there)
                return None
        return None

    def close(self) -> None:
        self.running = False
        if self.thread is not None:
            self.thread.join(5)
            self.replies.close(linger=0)
        self.pub.close(linger=0)
        self.ring.close()
        for path, inode in self.files:
            unlink_if_ours(path, inode)
