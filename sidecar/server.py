"""Run the HTTP server. uvicorn's own signal handlers only set its exit flag; the app's
lifespan then drains in phases (see `Context.close`)."""
from __future__ import annotations

import importlib
import logging
import os
import resource
import socket

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sidecar.config import Config
from sidecar.datadir import UnusableDir, check_dirs
from sidecar.peer import PEER_KEY, bind_unix, peer_of, unlink_if_ours

log = logging.getLogger("kv_sidecar")
APP_FACTORY = "api.app:create_app"  # the composition root: sidecar never imports api directly


def build_app(config: Config):
    module, _, attr = APP_FACTORY.partition(":")
    return getattr(importlib.import_module(module), attr)(config)


class PeerHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus:
    - on the engine socket, every request's scope carries the connection's Peer
      (SO_PEERCRED, read once per connection);
    - a request head or body that stalls for `read_timeout` seconds closes the connection
      (the app sees a disconnect: a stalled upload's reservation is aborted);
    - past `max_connections` open connections, a new one is closed at once."""

    read_timeout = 30.0
    max_connections = 1024

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.peer = peer_of(transport.get_extra_info("socket"))
        self._stall = None
        if len(self.connections) > self.max_connections:
            log.warning("refused a connection: %d are open (the limit)", self.max_connections)
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.peer is not None:
            self.scope[PEER_KEY] = self.peer
        self._arm()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()   # the whole request is in: the app's own time is not limited here

    def _arm(self) -> None:
        self._disarm()
        self._stall = self.loop.call_later(self.read_timeout, self._stalled)

    def _disarm(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        if not self.transport.is_closing():
            self.transport.close()


def listeners(config: Config) -> list[socket.socket]:
    """The loopback TCP listener (operators, metrics, tools) and the engine socket."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    socks = [socket.create_server((config.host, config.port), family=family, backlog=2048)]
    if config.socket:
        socks.append(bind_unix(config.socket, config.socket_mode, config.socket_group))
    return socks


def uvicorn_config(app, config: Config) -> uvicorn.Config:
    protocol = type("Protocol", (PeerHttpProtocol,), {"read_timeout": config.read_timeout,
                                                       "max_connections": config.max_connections})
    # no proxy stands before the sidecar: a local caller's X-Forwarded-For is not trusted
    # (and one middleware fewer runs per request); no "server: uvicorn" banner either
    return uvicorn.Config(app, loop="uvloop", http=protocol, lifespan="on",
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
