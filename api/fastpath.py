"""The hot routes as raw ASGI, in front of FastAPI and inside the Guard (token, body size,
metrics still apply). FastAPI keeps every route, serves the rest, and documents these.

    Guard -> FastPath --POST exists | set | get | batch/exists, no query--> one handler
                      `-- anything else ---------------------------------> FastAPI

A served request costs one receive loop, one orjson parse, the store call and two
`send`s with a precomputed head: no routing table walk, no dependency resolution, no
Request/Response objects. Errors go through the same handlers as FastAPI's, so the
status, code and body are the same bytes. Each handler is `(ctx, scope, name, body)`:
the FastAPI routes call the same functions, so a change to one route is one line.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

import orjson
from starlette.requests import ClientDisconnect

from api.deps import ready
from api.errors import on_disconnect, on_domain_error
from api.wire import parse_object, receive_body
from sidecar import hybrid
from sidecar.context import Context
from sidecar.errors import BadRequest, SidecarError
from sidecar.peer import scope_peer

Handler = Callable[[Context, dict, Optional[str], dict], Awaitable[bytes]]
JSON = (b"content-type", b"application/json")
PREFIX = "/v1/namespaces/"


async def exists(ctx: Context, scope: dict, name: Optional[str], body: dict) -> bytes:
    return b'{"prefix":%d}' % await ctx.store.prefix(name, body.get("keys"))


async def set_pages(ctx: Context, scope: dict, name: Optional[str], body: dict) -> bytes:
    durable = body.get("durable", False)
    if not isinstance(durable, bool):
        raise BadRequest("'durable' must be true or false")
    stored = await ctx.store.set(name, body.get("keys"), body.get("buffer_id"), body.get("slots"),
                                 durable, scope_peer(scope))
    return orjson.dumps({"stored": stored})


async def get_pages(ctx: Context, scope: dict, name: Optional[str], body: dict) -> bytes:
    loaded = await ctx.store.get(name, body.get("keys"), body.get("buffer_id"), body.get("slots"),
                                 scope_peer(scope))
    return orjson.dumps({"loaded": loaded})


async def batch_exists(ctx: Context, scope: dict, name: Optional[str], body: dict) -> bytes:
    extra = hybrid.parse_extra(body.get("extra"))
    restorable = body.get("restorable", False)
    if not isinstance(restorable, bool):
        raise BadRequest("'restorable' must be a boolean")
    return orjson.dumps(await hybrid.batch_exists(ctx.store, body.get("keys"), body.get("kv"),
                                                  extra, restorable))


class Route:
    """What the Guard's metrics read (`scope["route"].path`), as FastAPI's routes give it."""
    __slots__ = ("path", "handler")

    def __init__(self, path: str, handler: Handler):
        self.path, self.handler = path, handler


PAGE_ROUTES = {op: Route(PREFIX + "{name}/" + op, h)
               for op, h in (("exists", exists), ("set", set_pages), ("get", get_pages))}
BATCH_EXISTS = Route("/v1/batch/exists", batch_exists)


def match(scope: dict) -> tuple[Optional[Route], Optional[str]]:
    """(route, namespace) for a hot request, (None, None) for FastAPI."""
    if scope["method"] != "POST" or scope["query_string"]:
        return None, None
    path = scope["path"]
    if path.startswith(PREFIX):
        name, _, op = path[len(PREFIX):].partition("/")
        return (PAGE_ROUTES.get(op), name) if name else (None, None)
    return (BATCH_EXISTS, None) if path == BATCH_EXISTS.path else (None, None)


class FastPath:
    """ASGI middleware: serve the hot routes, pass everything else to `app`."""

    def __init__(self, app, state: Any):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        route, name = match(scope) if scope["type"] == "http" else (None, None)
        if route is None:
            return await self.app(scope, receive, send)
        scope["route"] = route
        try:
            ctx = ready(self.state)
            body = parse_object(await receive_body(receive, ctx.config.max_json_body))
            out = await route.handler(ctx, scope, name, body)
        except SidecarError as exc:
            return await (await on_domain_error(None, exc))(scope, receive, send)
        except ClientDisconnect as exc:
            return await (await on_disconnect(None, exc))(scope, receive, send)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [JSON, (b"content-length", b"%d" % len(out))]})
        await send({"type": "http.response.body", "body": out})
