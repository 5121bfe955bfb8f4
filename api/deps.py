"""The dependency through which routes reach the context: 503 until the sidecar is ready.

It is `async` on purpose: FastAPI runs a sync dependency in a worker thread per request."""
from __future__ import annotations

from starlette.requests import Request

from sidecar.context import Context
from sidecar.errors import NotReady


async def context(request: Request) -> Context:
    return ready(request.app.state)


def ready(state) -> Context:
    """The app's context once it is ready, else 503."""
    ctx = getattr(state, "ctx", None)
    if ctx is None or not ctx.ready:
        raise NotReady("the sidecar is starting or shutting down; retry shortly")
    return ctx
