"""The sockets of KV events (sidecar/events.py collects and encodes them): the PUB that
sends every batch, the replay ring, the thread that serves replays from it, and the
admission that caps who may connect.

    loop:           send(topic, payload) -> PUB  [topic, seq, payload]   (never blocks)
                                        -> ring (the newest batches, replay_ring.py)
    replay thread:  ROUTER [id, b"", seq] -> [id, b"", topic, seq, payload] for each kept
                    batch from seq on, then [id, b"", b"", -1, b""]
    admission:      ZAP (inproc://zeromq.zap.01) answers each handshake on either socket;
                    their monitors tell it which connections are open

What subscribers and replay clients that do not read can cost the sidecar (a router may
hang with its connection open; any local user may connect to a loopback endpoint), all of
them together, bounded by `queue_bytes` (besides each connection's own buffers in libzmq,
some tens of KiB, and the kernel's socket buffers):

- Connections: at most `max_subscribers` on each socket at once. ZMQ takes every
  connection, so `Admission` answers each one's handshake (ZAP, which libzmq asks before
  it makes the connection's queue): past the cap it is refused (counted) and closed
  (at once, now and then at `HANDSHAKE_S`), holding no queue; its client connects again
  after its reconnect interval, so a router refused while the places were taken gets in
  once one is free. A connection that does not finish its handshake is closed after
  `HANDSHAKE_S` (it counts meanwhile).
- PUB: ZMQ queues each subscriber's batches up to its high-water mark, then drops them for
  that subscriber (it sees the gap in `seq` and replays). Subscribers that stopped at
  different times hold different batches (ZMQ shares a batch only among the queues it went
  to), so the bound is per subscriber times the cap: `Limits.sndhwm`, what `queue_bytes`
  holds for `max_subscribers` subscribers and as many replay clients, each with the batch
  its connection is writing. A batch is at most `batch_bytes` (events.py splits them).
  Before (issue 52), the mark was the whole budget for each subscriber and nothing capped
  them: 20 that never read grew the sidecar by 324-391 MiB. vLLM's publisher keeps
  100,000 batches: tens of GB of this sidecar's for one subscriber that stopped.
- ROUTER: a replay is copied out of the ring batch by batch, `replay_hwm` batches queued
  to its client at most, one replay at a time, at `rate` bytes a second at most (the
  thread's copies take the GIL from the event loop). A client that keeps the thread
  waiting `stall` seconds in all is given up (counted): one that reads slowly holds it no
  longer than one that reads nothing. What was queued to a client given up stays queued
  until it disconnects: `replay_hwm` batches, in the budget above.

Not bounded: what a process that speaks ZMTP itself can send (a message whose parts
never end is kept whole), and the subscriptions a subscriber sends. So the endpoints are
for routers the operator trusts, and the cap is first come first served: an `ipc://`
endpoint is a Unix socket made by `unix` (`--kv-events-mode`, `--kv-events-group`: not the
engine socket's), which other users cannot connect to; loopback TCP is open to every user.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar.config import EVENTS_MIN_HWM, EVENTS_REPLAY_HWM
from sidecar.peer import unlink_if_ours
from sidecar.replay_ring import ReplayRing

if TYPE_CHECKING:  # the `events` extra
    import zmq

log = logging.getLogger("kv_sidecar.events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_SUBSCRIPTION = 4096  # bytes of a subscription message (a topic prefix) at most
MIN_HWM = EVENTS_MIN_HWM  # batches (sidecar/config.py; docs/kv-events.md, Limits)
HANDSHAKE_S = 5  # s a connection's handshake may take (a place held meanwhile)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27), in our own context
PUB_DOMAIN, REPLAY_DOMAIN = b"kv-events", b"kv-events-replay"  # which socket asks
ADMITTED = b"200"
# A refusal: not a ZAP status code, so libzmq closes the connection at once without an
# ERROR command (which its client would take as final: no reconnecting), and the client
# connects again after its reconnect interval. "300" (temporary) leaves it open until its
# handshake times out, a place counted meanwhile.
REFUSED = b"429"
ACCEPTED, DISCONNECTED = 0x0020, 0x0200  # ZMQ_EVENT_ACCEPTED, ZMQ_EVENT_DISCONNECTED
CLOSE_GRACE_S = 0.2  # s the admission still answers after the sockets close (`close`)
CLOSE_S = 5.0  # s ZMQ may take to end at close (else its context is left, logged)
REFUSED_LOG_S = 60.0  # a refusal is logged at most this often (each counted)


@dataclass(frozen=True, slots=True)
class Limits:
    """What subscribers and replay clients may hold of the sidecar (module docstring)."""

    hwm: int = 1000  # batches queued to one subscriber at most (`--kv-events-hwm`)
    replay_hwm: int = EVENTS_REPLAY_HWM  # batches queued to one replay client, then wait
    stall: float = 5.0  # s a replay waits for its client in all, then gives up
    rate: float = 128 * 2**20  # bytes a second a replay sends at most
    max_subscribers: int = 4  # connections each socket admits at once (refused past it)
    queue_bytes: int = 64 * 2**20  # queued to every connection together, at most
    batch_bytes: int = 256 * 2**10  # one batch at most (events.py splits to fit)

    @classmethod
    def of(cls, config: Any) -> Limits:
        """The limits a sidecar's configuration (sidecar/config.py) sets."""
        return cls(
            hwm=config.kv_events_hwm,
            max_subscribers=config.kv_events_max_subscribers,
            queue_bytes=config.kv_events_queue_bytes,
            batch_bytes=config.kv_events_batch_bytes,
        )

    @property
    def sndhwm(self) -> int:
        """The PUB's high-water mark: `hwm` batches, fewer where `max_subscribers`
        subscribers with that many and `max_subscribers` replay clients with `replay_hwm`,
        each connection one more (the batch it is writing), would pass `queue_bytes`."""
        each = self.queue_bytes // (self.max_subscribers * self.batch_bytes)
        return min(self.hwm, each - (self.replay_hwm + 1) - 1)

    @property
    def held_bytes(self) -> int:
        """The most every connection's queue holds together: `queue_bytes` at most."""
        each = self.sndhwm + 1 + self.replay_hwm + 1
        return self.max_subscribers * each * self.batch_bytes


class Door:
    """One socket's connections, as its monitor tells: a connection's fd from its
    ACCEPTED to its DISCONNECTED (libzmq reports both for every connection it takes, and
    ACCEPTED before the connection's handshake can ask anything)."""

    def __init__(self, name: str, cap: int, monitor):
        self.name, self.cap, self.monitor = name, cap, monitor
        self.open: set[int] = set()  # fds of the connections open now
        self.refused = 0  # handshakes refused (a refused client connects again: each counted)
        self.logged = -REFUSED_LOG_S

    def event(self, frames: list) -> None:
        """A monitor message: [event (u16) and value (u32), endpoint]."""
        event, fd = struct.unpack("=HI", frames[0][:6])
        if event == ACCEPTED:
            self.open.add(fd)
        elif event == DISCONNECTED:
            self.open.discard(fd)

    def admit(self) -> bool:
        """A handshake asks (every ACCEPTED before it read): admitted while the open
        connections, the asking one among them, are `cap` at most. Every admitted
        connection open now is among them, so at most `cap` hold a queue, whatever
        the order of connects, handshakes and closes. The others count too while they
        are open: one in its handshake for milliseconds, a refused one until libzmq has
        closed it (at once, now and then only at `HANDSHAKE_S`: libzmq's, seen 3 first
        refusals in 40), one that never shows a handshake `HANDSHAKE_S`."""
        if len(self.open) <= self.cap:
            return True
        self.refused += 1
        now = time.monotonic()
        if now - self.logged >= REFUSED_LOG_S:
            self.logged = now
            log.warning(
                "kv events: refused a connection to the %s socket: %d open, %d at most "
                "(--kv-events-max-subscribers; %d refused so far)",
                self.name,
                len(self.open) - 1,
                self.cap,
                self.refused,
            )
        return False


class Admission:
    """Who may connect to the event sockets: a ZAP handler (RFC 27) in the publisher's
    own context, which libzmq asks at each handshake on a socket with a ZAP domain, and
    each socket's monitor (its own thread, `kv-events-admission`)."""

    def __init__(self, zmq, ctx, cap: int):
        self.zmq, self.ctx, self.cap = zmq, ctx, cap
        self.zap = ctx.socket(zmq.ROUTER)
        self.zap.bind(ZAP_ENDPOINT)  # before any socket it answers for binds
        self.doors: dict[bytes, Door] = {}
        self.watched: list = []  # the sockets whose monitors feed `doors`
        self.running = True
        self.thread: threading.Thread | None = None

    def watch(self, sock, domain: bytes, name: str) -> None:
        """Ask at each handshake on `sock` (before it binds) and follow its connections."""
        zmq = self.zmq
        sock.setsockopt(zmq.ZAP_DOMAIN, domain)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_S * 1000)
        endpoint = f"inproc://kv-events-monitor.{name}"
        sock.monitor(endpoint, ACCEPTED | DISCONNECTED)
        monitor = self.ctx.socket(zmq.PAIR)
        # no high-water mark: libzmq's I/O thread blocks while a monitor's queue is full
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.connect(endpoint)
        self.doors[domain] = Door(name, self.cap, monitor)
        self.watched.append(sock)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="kv-events-admission", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        for sock in (self.zap, *(d.monitor for d in self.doors.values())):
            poller.register(sock, zmq.POLLIN)
        while self.running:
            try:
                poller.poll(100)
                self._serve()
            except Exception:  # a handshake unanswered waits: never leave them all so
                if not self.running:
                    return
                log.exception("kv events: the admission failed a turn; it goes on")
                time.sleep(0.1)

    def _serve(self) -> None:
        self._drain()
        while True:
            try:
                request = self.zap.recv_multipart(self.zmq.NOBLOCK)
            except self.zmq.Again:
                return
            self._drain()  # its connection's ACCEPTED came before it
            self._answer(request)

    def _drain(self) -> None:
        for door in self.doors.values():
            while True:
                try:
                    door.event(door.monitor.recv_multipart(self.zmq.NOBLOCK))
                except self.zmq.Again:
                    break

    def _answer(self, request: list) -> None:
        """[id, b"", version, request id, domain, address, routing id, mechanism, ...]"""
        if len(request) < 8 or request[1]:
            return  # not libzmq's (none other reaches an inproc endpoint of this context)
        door = self.doors.get(request[4])
        status = ADMITTED if door is not None and door.admit() else REFUSED
        self.zap.send_multipart((request[0], b"", b"1.0", request[3], status, b"", b"", b""))

    def stats(self, domain: bytes) -> tuple[int, int]:
        """(connections open, handshakes refused) on the socket of `domain`."""
        door = self.doors.get(domain)
        return (len(door.open), door.refused) if door is not None else (0, 0)

    def stop(self) -> None:
        self.running = False
        if self.thread is not None:
            self.thread.join(5)

    def unwatch(self) -> None:
        """Stop each socket's monitor, before the socket closes (the order `close` needs)."""
        for sock in self.watched:
            sock.disable_monitor()

    def close(self) -> None:
        """Once the sockets it answers for are closed, their monitors stopped first
        (`unwatch`): it answers for `CLOSE_GRACE_S` more while libzmq ends their
        connections' ZAP pipes, then its thread stops and its sockets close. Out of this
        order libzmq (4.3.5) could not always end the context: a socket closed with its
        monitor on, or the ZAP socket closed while closing connections' ZAP pipes ended,
        left `zmq_ctx_term` waiting for good, up to 1 close in 12 with clients knocking
        (in this order, 1 in 90 still: `Publisher._close_sockets` allows for it)."""
        if self.thread is not None:
            time.sleep(CLOSE_GRACE_S)
        self.stop()
        for door in self.doors.values():
            door.monitor.close(linger=0)
        self.zap.close(linger=0)


class Publisher:
    """The PUB socket (sent on the event loop: a PUB never blocks, it drops past its
    high-water mark, and ZMQ's own I/O thread does the sending), the replay ring, the
    replay thread that owns the ROUTER socket and reads the ring, and the admission of
    connections to both (`Admission`, its own thread)."""

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
        self.hwm = limits.sndhwm  # batches queued to one subscriber
        if self.hwm < 1 or limits.max_subscribers < 1:
            raise ValueError(f"kv events limits leave no queue for a subscriber: {limits}")
        # its own context: the ZAP handler that admits connections is a context's
        self.ctx: zmq.Context = zmq.Context()
        self.files: list[tuple[str, int]] = []  # the ipc:// socket files made here
        self.ring = ReplayRing(keep, keep_bytes)
        self.seq = 0
        self.replays = self.replays_given_up = 0
        self.router: zmq.Socket | None = None
        self.thread: threading.Thread | None = None
        self.running = True
        self.admission = Admission(zmq, self.ctx, limits.max_subscribers)
        try:
            self.pub = self._socket(zmq.PUB, PUB_DOMAIN, "PUB")
            self.pub.set_hwm(self.hwm)
            self.pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION)  # what a subscriber sends
            if replay:
                self.router = self._socket(zmq.ROUTER, REPLAY_DOMAIN, "replay")
                self.router.setsockopt(zmq.SNDHWM, limits.replay_hwm)
                self.router.setsockopt(zmq.MAXMSGSIZE, 64)  # a request is 8 bytes
                # a full queue or a gone client: an error
                self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.admission.start()  # before anyone can connect
            self._bind(self.pub, endpoint)
            if replay:
                self._bind(self.replies, replay)
        except BaseException:
            self.running = False
            self._close_sockets()
            self.ring.close()
            for path, inode in self.files:
                unlink_if_ours(path, inode)
            raise
        if replay:
            self.thread = threading.Thread(
                target=self._serve_replay, name="kv-events-replay", daemon=True
            )
            self.thread.start()

    @property
    def replies(self) -> zmq.Socket:
        """The ROUTER: made with the replay thread, its one user (and `close`'s after it)."""
        assert self.router is not None, "a replay without a replay endpoint"
        return self.router

    def _socket(self, kind: int, domain: bytes, name: str):
        """A socket whose connections the admission counts, and whose peers the kernel
        checks on (a router's host that went away frees its place in minutes)."""
        zmq = self.zmq
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 60)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 10)
        self.admission.watch(sock, domain, name)
        return sock

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

    def _close_sockets(self) -> None:
        """The event sockets (their monitors stopped first), the admission, then the
        context, which ends ZMQ's threads: in a thread of its own, given `CLOSE_S`, so
        that a context libzmq cannot end holds up nothing (it is logged, and left)."""
        self.admission.unwatch()
        for sock in (self.router, getattr(self, "pub", None)):
            if sock is not None:
                sock.close(linger=0)
        self.admission.close()
        ending = threading.Thread(target=self.ctx.term, name="kv-events-term", daemon=True)
        ending.start()
        ending.join(CLOSE_S)
        if ending.is_alive():
            log.warning("kv events: ZMQ did not end its context in %.0f s; left", CLOSE_S)

    def stats(self) -> dict[str, int]:
        """What `/v1/stats` `events` shows of the sockets' connections."""
        subscribers, refused = self.admission.stats(PUB_DOMAIN)
        clients, refused_clients = self.admission.stats(REPLAY_DOMAIN)
        return {
            "subscribers": subscribers,
            "refused_subscribers": refused,
            "replay_clients": clients,
            "refused_replay_clients": refused_clients,
            "subscriber_hwm": self.hwm,
        }

    def close(self) -> None:
        self.running = False
        if self.thread is not None:
            self.thread.join(5)
        self._close_sockets()
        self.ring.close()
        for path, inode in self.files:
            unlink_if_ours(path, inode)
