"""Run the HTTP server. uvicorn's own signal handlers only set its exit flag; the app's
lifespan then drains in phases (see `Context.close`)."""
from __future__ import annotations

import importlib
import json
import logging
import os
import resource
import socket
from typing import Optional

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from sidecar.config import Config
from sidecar.connections import CONN_KEY, ENGINE, TCP, Registry, refuse_fd_passing
from sidecar.datadir import UnusableDir, check_dirs
from sidecar.peer import PEER_KEY, bind_unix, peer_of, unlink_if_ours

log = logging.getLogger("kv_sidecar")
APP_FACTORY = "api.app:create_app"  # the composition root: sidecar never imports api directly


def build_app(config: Config):
    module, _, attr = APP_FACTORY.partition(":")
    return getattr(importlib.import_module(module), attr)(config)


LINGER_BYTES = 1 << 20    # after a refusal or a 401: what is read and dropped before closing
LINGER_SECONDS = 2.0


class _Refused(Exception):
    """Raised from a parser callback to stop the parser; `_refusal` says what to answer."""


class PeerHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus (`settings` is the Config, `registry` the counts;
    see sidecar/connections.py):
    - on the engine socket, every request's scope carries the connection's Peer
      (SO_PEERCRED, read once per connection);
    - admission: each listener has its own cap, the engine socket one per uid too; a TCP
      connection that has not shown the token (when one is set) gets `auth_timeout` to do so;
    - a request head (request line and headers) past `max_head` bytes, counted as they
      arrive and before they are joined, is answered 414/431 and closed, and so is one with
      more than `max_header_fields` fields (chunk framing and trailers count as a head);
    - a head or body that stalls for `read_timeout` seconds, or a body not whole within
      `body_timeout` of its head, closes the connection (the app sees a disconnect: a
      stalled upload's reservation is aborted);
    - writing paused (the client reads no answers) for `write_timeout` seconds: aborted."""

    settings: Config
    registry: Registry

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        self.peer = peer_of(sock)
        self._listener = ENGINE if getattr(sock, "family", None) == socket.AF_UNIX else TCP
        self._uid = self.peer.uid if self.peer is not None else None
        self._timer = self._write_timer = None
        self._refusal: Optional[tuple[int, str, str]] = None
        self._head_left = self.settings.max_head
        self._body_end = self._last = 0.0
        self._pending = self._listener == TCP and self.settings.token is not None
        self._unauthorized = self._lingering = False
        self._linger_left = 0
        why = self.registry.admit(self, self._listener, self._uid, self._pending)
        self._admitted = why is None
        if why is not None:      # refused before uvicorn's own set-up: a flood costs little
            self.transport = transport
            self.registry.tally.note(why)
            transport.close()
            return
        super().connection_made(transport)
        if self._pending:
            self.timeout_keep_alive = min(self.timeout_keep_alive, self.settings.auth_timeout)
        self._arm(self._head_timeout())

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._admitted:
            self._admitted = False
            self.registry.release(self, self._listener, self._uid)
        super().connection_lost(exc)

    # -- the token (called by the Guard) and eviction (by the Registry) --------------------
    def authenticated(self) -> None:
        """A request on this connection showed the valid token: ordinary timeouts from now."""
        if self._pending:
            self._pending = False
            self.registry.authenticated(self)
            self.timeout_keep_alive = self.config.timeout_keep_alive

    def unauthorized(self) -> None:
        """This connection's request is answered 401: the connection closes after it."""
        self._unauthorized = True

    def evict(self) -> None:
        self._admitted = False
        self.transport.abort()

    def on_response_complete(self) -> None:
        if not self._unauthorized:
            return super().on_response_complete()
        self.pipeline.clear()              # requests sent behind it are not served
        super().on_response_complete()
        self._linger()

    # -- bytes in: the head budget ---------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return self._drop(data)
        left = self._head_left
        if len(data) <= left:          # the common case: one feed
            self._head_left = left - len(data)
            return self._feed(data)
        view = memoryview(data)        # past the budget: feed it a budget at a time
        while view:
            left = self._head_left
            if left <= 0:
                return self._refuse_head()
            piece, view = view[:left], view[left:]
            self._head_left = left - len(piece)
            self._feed(piece)
            if self._lingering or self.transport.is_closing():
                return

    def _feed(self, data) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._refuse(*(self._refusal or (400, "bad_request", "invalid HTTP request")))
        except httptools.HttpParserUpgrade:
            pass   # no websockets here (ws="none"): the request was served as plain HTTP

    def _refuse_head(self) -> None:
        limit = self.settings.max_head
        if self._body_end:
            return self._refuse(431, "headers_too_large", f"chunk framing or trailers over {limit} bytes")
        if len(getattr(self, "url", b"")) > limit // 2:
            return self._refuse(414, "url_too_long", f"the request line is over {limit} bytes")
        self._refuse(431, "headers_too_large", f"the request head is over {limit} bytes")

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer `status` and close; an answer already going out is cut instead."""
        self.registry.tally.note(code)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or self.pipeline:
                return self.transport.abort()
            cycle.disconnected = True       # its app sees a disconnect; this is the answer
            cycle.message_event.set()
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        self.transport.write(STATUS_LINE[status] + b"content-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        self._linger()

    def _linger(self) -> None:
        """Close after an answer the client may still be sending into: shut down writing,
        then read and drop at most LINGER_BYTES for at most LINGER_SECONDS (a close with
        unread bytes would reset the connection, and the answer could be lost with it)."""
        if self.transport.is_closing():
            return
        self._lingering, self._linger_left = True, LINGER_BYTES
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(LINGER_SECONDS)

    def _drop(self, data: bytes) -> None:
        self._linger_left -= len(data)
        if self._linger_left < 0:
            self.transport.abort()

    # -- parser callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.peer is not None:
            self.scope[PEER_KEY] = self.peer
        elif self._pending:
            self.scope[CONN_KEY] = self
            self.registry.touch(self)
        self._arm(self._head_timeout())

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.settings.max_header_fields:
            self._refusal = (431, "headers_too_large",
                             f"more than {self.settings.max_header_fields} header fields")
            raise _Refused()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        now = self.loop.time()
        self._body_end, self._last = now + self.settings.body_timeout, now
        self._head_left = self.settings.max_head    # for chunk framing and trailers
        due = min(now + self.settings.read_timeout, self._body_end)
        if self._timer is None or self._timer.when() > due:
            self._arm(due - now)

    def on_chunk_header(self) -> None:
        self._head_left = self.settings.max_head    # each chunk's framing starts a budget

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._head_left += len(body)                # body bytes are not head bytes
        self._last = self.loop.time()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()   # the whole request is in: the app's own time is not limited here
        self._body_end = 0.0
        self._head_left = self.settings.max_head

    # -- bytes out -------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.settings.write_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stalled(self) -> None:
        self._write_timer = None
        self.registry.tally.note("write_stalled")
        self.transport.abort()      # drops what is buffered: close() would wait to send it

    # -- the read timer --------------------------------------------------------------------
    def _head_timeout(self) -> float:
        return self.settings.auth_timeout if self._pending else self.settings.read_timeout

    def _arm(self, delay: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._lingering:
            return self.transport.close()
        if self._body_end:
            now = self.loop.time()
            due = min(self._last + self.settings.read_timeout, self._body_end)
            if now < due:
                self._timer = self.loop.call_at(due, self._expired)
                return
            reason = "body_deadline" if now >= self._body_end else "read_stalled"
        else:
            reason = "auth_timeout" if self._pending else "read_stalled"
        self.registry.tally.note(reason)
        if not self.transport.is_closing():
            self.transport.close()


def listeners(config: Config) -> list[socket.socket]:
    """The loopback TCP listener (operators, metrics, tools) and the engine socket, which
    refuses fds sent with SCM_RIGHTS (the fd socket is the one place they are taken)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    socks = [socket.create_server((config.host, config.port), family=family, backlog=2048)]
    if config.socket:
        engine = bind_unix(config.socket, config.socket_mode, config.socket_group)
        refuse_fd_passing(engine)
        socks.append(engine)
    return socks


def uvicorn_config(app, config: Config) -> uvicorn.Config:
    protocol = type("Protocol", (PeerHttpProtocol,), {"settings": config, "registry": Registry(config)})
    # no proxy stands before the sidecar: a local caller's X-Forwarded-For is not trusted
    # (and one middleware fewer runs per request); no "server: uvicorn" banner either; no
    # websockets (no route takes one, and an upgraded connection would leave these limits)
    return uvicorn.Config(app, loop="uvloop", http=protocol, ws="none", lifespan="on",
                          access_log=False, log_level=config.log_level, proxy_headers=False,
                          server_header=False, timeout_graceful_shutdown=config.shutdown_timeout)


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the signal after shutdown: a drained SIGTERM exits 0.
    The handler only sets flags; the serve loop and the lifespan do the draining."""

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for connections
        self.should_exit = True


def _raise_fd_limit() -> None:
    """Every lent buffer holds an fd: take the hard limit, not a distribution's 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(config: Config) -> int:
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _raise_fd_limit()
    try:
        check_dirs(config)
    except UnusableDir as exc:
        log.error("cannot start: %s", exc)
        return 1
    try:
        socks = listeners(config)
    except (OSError, RuntimeError, ValueError) as exc:
        logging.getLogger("kv_sidecar").error("cannot listen: %s", exc)
        return 1
    inode = os.stat(config.socket).st_ino if config.socket else 0
    server = _Server(uvicorn_config(build_app(config), config))
    try:
        server.run(sockets=socks)
    finally:
        if config.socket:
            unlink_if_ours(config.socket, inode)
        for sock in socks:
            sock.close()
    return 0 if server.started else 1
