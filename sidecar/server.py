"""Run the HTTP server. uvicorn's own signal handlers only set its exit flag; the app's
lifespan then drains in phases (see `Context.close`)."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import re
import resource
import socket
from typing import Any, cast

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from sidecar.config import Config
from sidecar.connections import CLOSING_KEY, CONN_KEY, ENGINE, TCP, Registry, refuse_fd_passing
from sidecar.credentials import Credentials
from sidecar.datadir import UnusableDir, check_dirs
from sidecar.peer import PEER_KEY, bind_unix, peer_of, unlink_if_ours

log = logging.getLogger("kv_sidecar")
APP_FACTORY = "api.app:create_app"  # the composition root: sidecar never imports api directly


def build_app(config: Config):
    module, _, attr = APP_FACTORY.partition(":")
    return getattr(importlib.import_module(module), attr)(config)


LINGER_BYTES = 1 << 20  # after a refusal or a 401: what is read and dropped before closing
LINGER_SECONDS = 2.0
# Pipelining (issue 43): bytes are fed to the parser a piece at a time, each ending where a
# request head ends (or, inside a chunked body, at the first head end CHUNKED_PIECE bytes on,
# so that a body of CRLFs is not fed 4 bytes at a time); once a request is whole, the rest of
# the read waits, unparsed, until its answer is out. At most CHUNKED_PIECE / 18 + 2 requests
# are ever parsed ahead of their answers; PIPELINE_MAX is the bound past which the connection
# is cut (no client reaches it).
PIPELINE_MAX = 16
CHUNKED_PIECE = 128
HEAD_END = b"\r\n\r\n"
_BLANK_LINES = re.compile(rb"[\r\n]*")  # what the parser skips between two requests

# Chunked bodies (issue 52, item 3). A chunk costs Python two parser callbacks whatever its
# size, so the framing of a body is bounded by its data, two ways:
CHUNK_MIN_AVG = 1024
"""Each chunk spends CHUNK_MIN_AVG bytes of its body's credit and each data byte earns one
back; the credit starts at, and never exceeds, CHUNKS_AHEAD * CHUNK_MIN_AVG. A chunk header
with no credit left is refused, 400 `chunks_too_small`, and the connection closed. So any run
of k chunks carries at least (k - CHUNKS_AHEAD) * CHUNK_MIN_AVG bytes of data: at most one
chunk a KiB (two callbacks) once CHUNKS_AHEAD are spent, whatever came before, which also
bounds the Python work of one read (256 KiB: 64 + 256 chunks at most). Real clients send
chunks of KiBs (http.client and httpx: what the caller yields; aiohttp, curl: 16-64 KiB)."""
CHUNKS_AHEAD = 64
"""Chunks a body may send beyond what its data pays for (a small body in a few tiny chunks)."""
FRAMING_SHARE = 64
"""Chunk-size lines, extensions and trailers of one body share one `max_head` budget (not one
each), which grows by one byte every FRAMING_SHARE data bytes: 1 KiB chunks earn 16 bytes and
spend 7 (a size line of 3 hex digits, two CRLFs). Past it: 431 `headers_too_large`, closed."""


class _Refused(Exception):
    """Raised from a parser callback to stop the parser; `_refusal` says what to answer."""


class _Flow(FlowControl):
    """uvicorn's flow control, plus `hold`: while the protocol keeps bytes it has not parsed
    (the next pipelined request), reading stays paused whoever asks to resume it."""

    hold = False

    def resume_reading(self) -> None:
        if not self.hold:
            super().resume_reading()


class _Cycle(RequestResponseCycle):
    """uvicorn's request cycle; `PeerHttpProtocol.on_body` grows its body in place (a
    bytearray, never `bytes +=`, which copies the whole body each chunk), and the app gets it
    as bytes, whichever uvicorn runs (before 0.42 `receive` handed `self.body` out as is)."""

    async def receive(self):
        message = await super().receive()
        if message["type"] == "http.request" and type(message["body"]) is not bytes:
            message["body"] = bytes(message["body"])
        return message


class PeerHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus (`settings` is the Config, `registry` the counts;
    see sidecar/connections.py):
    - on the engine socket, every request's scope carries the connection's Peer
      (SO_PEERCRED, read once per connection);
    - admission: each listener has its own cap, the engine socket one per uid too; a TCP
      connection that has not shown the token (when one is set) gets `auth_timeout` to do so;
    - a request head (request line and headers) past `max_head` bytes, counted as they
      arrive and before they are joined, is answered 414/431 and closed, and so is one with
      more than `max_header_fields` fields; the chunk framing and trailers of one body share
      one such budget, grown by its data (FRAMING_SHARE), and a body of chunks too small for
      their data is refused at once (CHUNK_MIN_AVG, CHUNKS_AHEAD);
    - a head or body that stalls for `read_timeout` seconds, or a body not whole within
      `body_timeout` of its head, closes the connection (the app sees a disconnect: a
      stalled upload's reservation is aborted);
    - writing paused (the client reads no answers) for `write_timeout` seconds: aborted;
    - pipelining: a request is parsed only once the answer before it is out (the bytes after
      a whole request wait, unparsed, reading paused), and those bytes count against the
      next request's head from its first byte (see PIPELINE_MAX)."""

    settings: Config
    registry: Registry
    flow: _Flow

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        self.peer = peer_of(sock)
        self._listener = ENGINE if getattr(sock, "family", None) == socket.AF_UNIX else TCP
        self._uid = self.peer.uid if self.peer is not None else None
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str, str] | None = None
        self._head_left = self.settings.max_head
        self._body_end = self._last = 0.0
        self._pending = self._listener == TCP and self.settings.tcp_guarded
        self._unauthorized = self._lingering = False
        self._linger_left = 0
        self._held: bytes | None = None  # a read not yet parsed, from `_held_at` on
        self._held_at = self._piece = 0  # `_piece`: the length of what is being fed
        self._body_left: int | None = None  # of a body of declared length, while read
        self._chunk_credit = self._body_in = 0  # of a chunked body (see CHUNK_MIN_AVG)
        self._in_message = self._ended_in_piece = self._release_due = self._drain_due = False
        self._limits = (0, 0)  # the write buffer's (high, low), while draining
        why = self.registry.admit(self, self._listener, self._uid, self._pending)
        self._admitted = why is None
        if why is not None:  # refused before uvicorn's own set-up: a flood costs little
            self.transport = transport
            self.registry.tally.note(why)
            transport.close()
            return
        super().connection_made(transport)
        self.flow = _Flow(transport)
        if self._pending:
            # uvicorn annotates it int; it is seconds for call_later, a float does
            self.timeout_keep_alive = min(self.timeout_keep_alive, self.settings.auth_timeout)  # type: ignore[assignment]
        self._arm(self._head_timeout())

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._held = None
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
        if self._unauthorized:
            self.pipeline.clear()  # requests sent behind it are not served
            super().on_response_complete()
            return self._linger()
        super().on_response_complete()
        if (
            self._held is None
            or self._release_due
            or self._drain_due
            or self._answer_due()
            or self.transport.is_closing()
        ):
            return
        self._unset_keepalive_if_required()  # the next request is here: not idle
        if not self.transport.get_write_buffer_size():
            return self._release_soon()
        # the answer is not all out (the client is not reading): wait until it is, so that
        # a client that never reads holds one answer here, not one a request it sent
        self._drain_due, (low, high) = True, self.transport.get_write_buffer_limits()
        self._limits = (high, low)
        self.transport.set_write_buffer_limits(high=0, low=0)  # pause_writing now, resume once out

    def _release_soon(self) -> None:
        self._release_due = True  # parse the next on the loop's next turn
        self.loop.call_soon(self._release)

    # -- bytes in: the head budget and one request at a time ------------------------------
    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return self._drop(data)
        if self._held is not None:  # a read under way as reading paused: it waits too
            self._held, self._held_at = self._held[self._held_at :] + data, 0
            return
        self._consume(data, 0)
        self._idle_check()

    def _consume(self, data: bytes, pos: int) -> None:
        """Feed `data[pos:]` a piece at a time (each charged to the head budget; body bytes
        are given back by `on_body`), until a whole request waits for its answer: the rest
        is held, unparsed, and reading paused."""
        while pos < len(data):
            if self._answer_due():
                return self._hold(data, pos)
            if self._head_left <= 0:
                return self._refuse_head()
            end = self._piece_end(data, pos)
            self._head_left -= end - pos
            self._piece, self._ended_in_piece = end - pos, False
            self._feed(data if end - pos == len(data) else memoryview(data)[pos:end])
            self._piece = 0
            if self._lingering or self.transport.is_closing():
                return
            pos = end

    def _piece_end(self, data: bytes, pos: int) -> int:
        """Where the next piece of `data` ends: a body of declared length, exactly; else the
        next head end (within the budget), so that a request ends where its piece does."""
        limit = min(len(data), pos + self._head_left)
        if self._body_left:
            return min(limit, pos + self._body_left)
        if not self._in_message:
            blank = _BLANK_LINES.match(data, pos, limit)
            start = blank.end() if blank else pos
        else:  # mid-head; or chunk framing and data, at least CHUNKED_PIECE bytes a piece
            start = pos + CHUNKED_PIECE - len(HEAD_END) if self._body_end else pos
        i = data.find(HEAD_END, min(start, limit), limit)
        return limit if i < 0 else i + len(HEAD_END)

    def _answer_due(self) -> bool:
        """A whole request (or more, parsed from one piece) is waiting for its answer."""
        cycle = self.cycle
        return bool(self.pipeline) or (
            cycle is not None and not cycle.more_body and not cycle.response_complete
        )

    def _hold(self, data: bytes, pos: int) -> None:
        self._held, self._held_at = data, pos
        self.flow.hold = True
        self.flow.pause_reading()

    def _release(self) -> None:
        """The answer is out: parse what was held, up to the next whole request."""
        self._release_due = False
        data, pos = self._held, self._held_at
        if data is None or self._lingering or self.transport.is_closing():
            return
        self._held, self.flow.hold = None, False
        self._consume(data, pos)
        if (
            self._held is None
            and not self._lingering
            and not self._answer_due()
            and not (self.cycle is not None and len(self.cycle.body) > HIGH_WATER_LIMIT)
        ):
            self.flow.resume_reading()
        self._idle_check()

    def _idle_check(self) -> None:
        """Between requests with no timer (blank lines cancelled keep-alive's): arm one."""
        if self._held is None and not (
            self._in_message
            or self._timer
            or self._lingering
            or self._answer_due()
            or self.transport.is_closing()
        ):
            self._arm(self._head_timeout())

    def _feed(self, data) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._refuse(*(self._refusal or (400, "bad_request", "invalid HTTP request")))
        except httptools.HttpParserUpgrade:
            pass  # no websockets here (ws="none"): the request was served as plain HTTP

    def _refuse_head(self) -> None:
        limit = self.settings.max_head
        if self._body_end:
            return self._refuse(
                431,
                "headers_too_large",
                f"chunk framing or trailers over {limit} bytes and 1/{FRAMING_SHARE} of the data",
            )
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
            cycle.disconnected = True  # its app sees a disconnect; this is the answer
            cycle.message_event.set()
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        self.transport.write(
            STATUS_LINE[status] + b"content-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body
        )
        self._linger()

    def _linger(self) -> None:
        """Close after an answer the client may still be sending into: shut down writing,
        then read and drop at most LINGER_BYTES for at most LINGER_SECONDS (a close with
        unread bytes would reset the connection, and the answer could be lost with it)."""
        if self.transport.is_closing():
            return
        self._lingering, self._linger_left = True, LINGER_BYTES
        self._held, self.flow.hold = None, False
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
        if len(self.pipeline) >= PIPELINE_MAX:
            self._refusal = (429, "pipeline_full", f"over {PIPELINE_MAX} requests sent ahead")
            raise _Refused()
        self._in_message = True
        if (
            self._ended_in_piece
        ):  # begun in the piece that ended the one before: all its bytes count
            self._head_left = self.settings.max_head - self._piece
        super().on_message_begin()
        scope = cast("dict[str, Any]", self.scope)  # our keys beside the ASGI ones
        scope[CLOSING_KEY] = self.transport.is_closing  # a long answer stops streaming
        if self.peer is not None:
            scope[PEER_KEY] = self.peer
        elif self._pending:
            scope[CONN_KEY] = self
            self.registry.touch(self)
        self._arm(self._head_timeout())

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.settings.max_header_fields:
            self._refusal = (
                431,
                "headers_too_large",
                f"more than {self.settings.max_header_fields} header fields",
            )
            raise _Refused()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:
            self.cycle.__class__ = _Cycle  # its task has not run yet: it receives through ours
        now = self.loop.time()
        self._body_end, self._last = now + self.settings.body_timeout, now
        self._head_left = self.settings.max_head  # for all chunk framing and trailers
        self._body_left = _declared_length(self.headers)
        self._chunk_credit, self._body_in = CHUNKS_AHEAD * CHUNK_MIN_AVG, 0
        due = min(now + self.settings.read_timeout, self._body_end)
        if self._timer is None or self._timer.when() > due:
            self._arm(due - now)

    def on_chunk_header(self) -> None:
        """Each chunk (the last, empty one too) spends CHUNK_MIN_AVG of the body's credit."""
        self._chunk_credit -= CHUNK_MIN_AVG
        if self._chunk_credit < 0:
            self._refusal = (
                400,
                "chunks_too_small",
                f"the body's chunks average under {CHUNK_MIN_AVG} bytes of data",
            )
            raise _Refused()

    def on_body(self, body: bytes) -> None:
        """uvicorn's, but the body grows in place: `bytes +=` copied all of it each chunk."""
        n, cycle = len(body), self.cycle
        if not cycle.response_complete:  # (no upgrade to skip: ws="none")
            buf = cycle.body
            if type(buf) is not bytearray:  # uvicorn before 0.42: bytes, b"" once received
                cycle.body = buf = bytearray(buf)
            buf += body
            if len(buf) > HIGH_WATER_LIMIT:
                self.flow.pause_reading()
            cycle.message_event.set()
        self._head_left += n  # body bytes are not head bytes
        if self._body_left is not None:
            self._body_left -= n
        else:  # chunked: data earns chunks (up to the cap) and framing bytes
            self._chunk_credit = min(self._chunk_credit + n, CHUNKS_AHEAD * CHUNK_MIN_AVG)
            before, self._body_in = self._body_in, self._body_in + n
            self._head_left += self._body_in // FRAMING_SHARE - before // FRAMING_SHARE
        self._last = self.loop.time()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()  # the whole request is in: the app's own time is not limited here
        self._body_end = 0.0
        self._head_left = self.settings.max_head
        self._body_left, self._in_message = None, False
        self._ended_in_piece = self._piece > 0  # the rest of this piece is the next request's

    # -- bytes out -------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self.settings.write_timeout, self._write_stalled
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._drain_due:  # the answer is out: the next request may be read
            self._drain_due = False
            high, low = self._limits
            self.transport.set_write_buffer_limits(high=high, low=low)
            if self._held is not None and not self.transport.is_closing():
                self._release_soon()

    def _write_stalled(self) -> None:
        self._write_timer = None
        self.registry.tally.note("write_stalled")
        self.transport.abort()  # drops what is buffered: close() would wait to send it

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


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body's Content-Length (the parser checked it), None when chunked or not given."""
    length = None
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length" and value.strip().isdigit():
            length = int(value)
    return length


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
    protocol = type(
        "Protocol", (PeerHttpProtocol,), {"settings": config, "registry": Registry(config)}
    )
    # no proxy stands before the sidecar: a local caller's X-Forwarded-For is not trusted
    # (and one middleware fewer runs per request); no "server: uvicorn" banner either; no
    # websockets (no route takes one, and an upgraded connection would leave these limits)
    return uvicorn.Config(
        app,
        loop="uvloop",
        http=protocol,
        ws="none",
        lifespan="on",
        access_log=False,
        log_level=config.log_level,
        proxy_headers=False,
        server_header=False,
        # annotated int by uvicorn, used as seconds by asyncio: a float does
        timeout_graceful_shutdown=config.shutdown_timeout,  # type: ignore[arg-type]
    )


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
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _raise_fd_limit()
    try:
        check_dirs(config)
    except UnusableDir as exc:
        log.error("cannot start: %s", exc)
        return 1
    try:
        Credentials.of(config.token, config.tenant_tokens_file)  # read again by the app
    except (OSError, ValueError) as exc:
        log.error("cannot start: --tenant-tokens: %s", exc)
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
