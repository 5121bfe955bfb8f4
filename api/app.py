"""`create_app(config)`: the FastAPI app; its lifespan builds and closes the one Context."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI

from api import (
    routes_batch,
    routes_controls,
    routes_health,
    routes_namespaces,
    routes_pages,
    routes_ui,
)
from api.errors import HANDLERS
from api.fastpath import FastPath, SidecarApp
from api.guard import Guard
from sidecar import __version__
from sidecar.config import Config
from sidecar.context import Context
from sidecar.credentials import Credentials
from sidecar.metrics import RequestStats

log = logging.getLogger("kv_sidecar")


def create_app(config: Config) -> FastAPI:
    """A new app for `config`; nothing is allocated until its lifespan starts."""
    requests = RequestStats()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx = await asyncio.get_running_loop().run_in_executor(None, Context.build, config)
        ctx.requests = requests
        app.state.ctx = ctx
        ctx.start()
        log.info("kv-sidecar %s ready on %s:%d", __version__, config.host, config.port)
        try:
            yield
        finally:
            log.info("draining")
            await ctx.close()
            app.state.ctx = None
            log.info("stopped")

    app = SidecarApp(
        title="kv-sidecar", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.ctx = None
    # the page routes first: routing tries routes in order, and they are the hot path
    for router in (
        routes_pages.router,
        routes_batch.router,
        routes_namespaces.router,
        routes_health.router,
    ):
        app.include_router(router)
    app.include_router(routes_ui.router)  # /ui, /v1/samples, /docs
    app.include_router(routes_controls.router)  # pin, unpin, evict, warm, /v1/cost
    for exc, handler in HANDLERS.items():
        app.add_exception_handler(exc, handler)
    creds = Credentials.of(config.token, config.tenant_tokens_file)
    app.add_middleware(Guard, credentials=creds, max_body=config.max_body, stats=requests)
    # the hot routes, ahead of FastAPI's layers, behind a Guard of their own (same metrics)
    app.hot = Guard(
        FastPath(app.state), credentials=creds, max_body=config.max_body, stats=requests
    )
    return app
