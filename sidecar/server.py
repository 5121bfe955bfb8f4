"""Run the HTTP server. uvicorn's own signal handlers only set its exit flag; the app's
lifespan then drains in phases (see `Context.close`)."""
from __future__ import annotations

import importlib
import logging

import uvicorn

from sidecar.config import Config

APP_FACTORY = "api.app:create_app"  # the composition root: sidecar never imports api directly


def build_app(config: Config):
    module, _, attr = APP_FACTORY.partition(":")
    return getattr(importlib.import_module(module), attr)(config)


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the signal after shutdown: a drained SIGTERM exits 0.
    The handler only sets flags; the serve loop and the lifespan do the draining."""

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for connections
        self.should_exit = True


def serve(config: Config) -> int:
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uv = uvicorn.Config(build_app(config), host=config.host, port=config.port, loop="uvloop",
                        http="httptools", lifespan="on", access_log=False,
                        log_level=config.log_level, timeout_graceful_shutdown=config.shutdown_timeout)
    server = _Server(uv)
    server.run()
    return 0 if server.started else 1
