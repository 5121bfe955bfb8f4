"""The dependency through which routes reach the context: 503 until the sidecar is ready.

It is `async` on purpose: FastAPI runs a sync dependency in a worker thread per request."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.types import Scope

from sidecar.context import Context
from sidecar.credentials import TENANT_KEY
from sidecar.errors import NotReady
from sidecar.namespace import Ref
from sidecar.peer import PEER_KEY
from sidecar.tenancy import Caller


async def context(request: Request) -> Context:
    return ready(request.app.state)


def who(ctx: Context, scope: Scope) -> Caller:
    """Who asks (sidecar/tenancy.py): the engine socket's peer, else on TCP a tenant (its
    token), the operator (the operator's token) or an anonymous TCP caller."""
    return ctx.store.caller(scope.get(PEER_KEY), scope.get(TENANT_KEY))


def ref(ctx: Context, scope: Scope, name: str) -> Ref:
    """The namespace `name` means to the caller of this request (404 when none)."""
    return ctx.store.resolve(name, who(ctx, scope))


def observer(ctx: Context, scope: Scope) -> Caller:
    """Whose namespaces /v1/stats, /metrics, /v1/cost and /v1/samples name: the caller's
    (a peer's or a tenant's own; every one for the operator). Totals without names are the
    node's for everyone."""
    return who(ctx, scope)


def ready(state: Any) -> Context:
    """The app's context once it is ready, else 503."""
    ctx = getattr(state, "ctx", None)
    if ctx is None or not ctx.ready:
        raise NotReady("the sidecar is starting or shutting down; retry shortly")
    return ctx
