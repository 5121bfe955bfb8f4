"""The hot routes as raw ASGI, before any of FastAPI's layers but inside a Guard of their
own (same token, body size and metrics as the app's). FastAPI keeps every route, serves
the rest, and documents these.

    uvicorn -> SidecarApp --POST exists | set | get | batch/exists, no query--> Guard -> FastPath
                         `-- anything else --> FastAPI (its middleware, Guard, routes)

A served request costs one receive loop, one orjson parse, the store call and two
`send`s with a precomputed head: no routing table walk, no dependency resolution, no
Request/Response objects, no telemetry or error middleware. Errors go through the same
handlers as FastAPI's, so the status, code and body are the same bytes (an unexpected
error answers 500 as FastAPI's ServerErrorMiddleware would, then propagates to the
server's log). Each handler is `(ctx, scope, name, body)`: the FastAPI routes call the
same functions, so a change to one route is one line. The look-ups answer on the event
loop; only a remote tier (Mooncake) is awaited.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.types import Scope

from api.deps import ready, ref, who
from api.errors import on_disconnect, on_domain_error, on_unexpected
from api.wire import parse_object, receive_body
from sidecar import hybrid
from sidecar.context import Context
from sidecar.errors import BadRequest, SidecarError
from sidecar.events import check_tokens, set_meta
from sidecar.peer import scope_peer

# (ctx, scope, namespace: None for batch/exists alone, request body)
Handler = Callable[[Context, Scope, str | None, dict], Awaitable[bytes]]
JSON = (b"content-type", b"application/json")
PREFIX = "/v1/namespaces/"
HOT = "kv_sidecar.hot"  # scope key: the matched (route, namespace), until the Guard lets it in


async def exists(ctx: Context, scope: Scope, name: str | None, body: dict) -> bytes:
    assert name is not None, "a page route without its namespace"
    keys: Any = body.get("keys")  # the request's JSON: local_prefix validates it
    name = ref(ctx, scope, name)
    n, more = ctx.store.lookup.local_prefix(name, keys)
    local = n
    if more:
        n = await ctx.store.lookup.remote_prefix(name, keys, n)
    if body.get("where") is True:  # where the prefix lies: host pool, then local tiers, then remote
        host = min(ctx.store.namespace(name).pool.prefix(keys), local) if local else 0
        return b'{"prefix":%d,"host":%d,"local":%d}' % (n, host, local)
    return b'{"prefix":%d}' % n


async def set_pages(ctx: Context, scope: Scope, name: str | None, body: dict) -> bytes:
    assert name is not None, "a page route without its namespace"
    durable = body.get("durable", False)
    if not isinstance(durable, bool):
        raise BadRequest("'durable' must be true or false")
    ns, meta = ref(ctx, scope, name), set_meta(body)
    if meta is not None:  # token ids a key: the namespace's page_tokens at most
        check_tokens(meta, ctx.store.namespace(ns).spec.page_tokens)
    stored = await ctx.store.set(
        ns,
        body.get("keys"),
        body.get("buffer_id"),
        body.get("slots"),
        durable,
        scope_peer(scope),
        meta,
    )
    return orjson.dumps({"stored": stored})


async def get_pages(ctx: Context, scope: Scope, name: str | None, body: dict) -> bytes:
    assert name is not None, "a page route without its namespace"
    loaded = await ctx.store.get(
        ref(ctx, scope, name),
        body.get("keys"),
        body.get("buffer_id"),
        body.get("slots"),
        scope_peer(scope),
    )
    return orjson.dumps({"loaded": loaded})


async def batch_exists(ctx: Context, scope: Scope, name: str | None, body: dict) -> bytes:
    extra = hybrid.parse_extra(body.get("extra"))
    restorable = body.get("restorable", False)
    if not isinstance(restorable, bool):
        raise BadRequest("'restorable' must be a boolean")
    return orjson.dumps(
        await hybrid.batch_exists(
            ctx.store, body.get("keys"), body.get("kv"), extra, restorable, who(ctx, scope)
        )
    )


class Route:
    """What the Guard's metrics read (`scope["route"].path`), as FastAPI's routes give it."""

    __slots__ = ("path", "handler")

    def __init__(self, path: str, handler: Handler):
        self.path, self.handler = path, handler


PAGE_ROUTES = {
    op: Route(PREFIX + "{name}/" + op, h)
    for op, h in (("exists", exists), ("set", set_pages), ("get", get_pages))
}
BATCH_EXISTS = Route("/v1/batch/exists", batch_exists)


def match(scope: Scope) -> tuple[Route | None, str | None]:
    """(route, namespace) for a hot request, (None, None) for FastAPI."""
    if scope["method"] != "POST" or scope["query_string"]:
        return None, None
    path = scope["path"]
    if path.startswith(PREFIX):
        name, _, op = path[len(PREFIX) :].partition("/")
        return (PAGE_ROUTES.get(op), name) if name else (None, None)
    return (BATCH_EXISTS, None) if path == BATCH_EXISTS.path else (None, None)


_HEADS: dict[int, dict] = {}  # the 200 response start, by body length (small bodies)


def _start(out: bytes) -> dict:
    """The response start for `out`, made once per length (uvicorn copies the headers)."""
    head = _HEADS.get(len(out))
    if head is None:
        head = {
            "type": "http.response.start",
            "status": 200,
            "headers": [JSON, (b"content-length", b"%d" % len(out))],
        }
        if len(out) < 4096:
            _HEADS[len(out)] = head
    return head


class FastPath:
    """ASGI app for a request `SidecarApp` matched (behind a Guard): one handler, no routing."""

    def __init__(self, state: Any):
        self.state = state

    async def __call__(self, scope, receive, send):
        route, name = scope.pop(HOT)
        scope["route"] = route
        try:
            ctx = ready(self.state)
            body = parse_object(await receive_body(receive, ctx.config.max_json_body))
            out = await route.handler(ctx, scope, name, body)
        except SidecarError as exc:
            return await (await on_domain_error(Request(scope), exc))(scope, receive, send)
        except ClientDisconnect as exc:
            return await (await on_disconnect(Request(scope), exc))(scope, receive, send)
        except Exception as exc:  # as FastAPI's ServerErrorMiddleware: answer 500, re-raise
            await (await on_unexpected(Request(scope), exc))(scope, receive, send)
            raise
        await send(_start(out))
        await send({"type": "http.response.body", "body": out})


class SidecarApp(FastAPI):
    """FastAPI, with the hot requests sent to `hot` (a Guard around a FastPath) before any
    of FastAPI's own layers run; lifespan and every other request go to FastAPI."""

    hot: Callable[..., Awaitable[None]] | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.hot is not None:
            route, name = match(scope)
            if route is not None:
                scope[HOT] = (route, name)
                return await self.hot(scope, receive, send)
        await super().__call__(scope, receive, send)
