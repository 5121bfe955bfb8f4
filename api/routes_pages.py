"""Pages of one namespace: exists, set, get, delete, and inline octet-stream pages."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import Response

from api import fastpath
from api.deps import context, ref, who
from api.openapi import PAGE_BODY, body
from api.wire import flag, json, raw_json, read_json
from sidecar.answers import PageAnswer
from sidecar.connections import CLOSING_KEY
from sidecar.context import Context
from sidecar.errors import BadRequest, KeyNotFound

router = APIRouter(prefix="/v1/namespaces/{name}")
OCTETS = "application/octet-stream"
MAX_SKIPPED = 4096  # loads one report counts (an engine reports each, or a few at once)


@router.post("/exists", openapi_extra=body("exists"))
async def exists(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    if flag(request, "each"):
        return json(
            {
                "present": await ctx.store.lookup.present(
                    ref(ctx, request.scope, name), body.get("keys")
                )
            }
        )
    return raw_json(await fastpath.exists(ctx, request.scope, name, body))


@router.post("/skipped", openapi_extra=body("skipped"))
async def skipped(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    """An engine recomputed prefixes it could have restored (slower than its prefill):
    counted on the caller's own namespace (`restores_skipped`)."""
    body = await read_json(request, ctx.config.max_json_body)
    loads, pages = bounded(body, "loads", MAX_SKIPPED), bounded(body, "pages", MAX_SKIPPED * 4096)
    total = ctx.store.count_skipped(
        ref(ctx, request.scope, name), who(ctx, request.scope), loads, pages
    )
    return json({"restores_skipped": total})


def bounded(body: dict, field: str, limit: int) -> int:
    value = body.get(field, 0)
    if type(value) is not int or not 0 <= value <= limit:
        raise BadRequest(f"{field!r} must be an integer from 0 to {limit}")
    return value


@router.post("/set", openapi_extra=body("move"))
async def set_pages(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    return raw_json(await fastpath.set_pages(ctx, request.scope, name, body))


@router.post("/get", openapi_extra=body("move"))
async def get_pages(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    return raw_json(await fastpath.get_pages(ctx, request.scope, name, body))


@router.post("/delete", openapi_extra=body("keys"))
async def delete_pages(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    deleted, failed = await ctx.store.delete(ref(ctx, request.scope, name), body.get("keys"))
    return json({"deleted": deleted, "failed": failed})


@router.put("/pages/{key}", openapi_extra=PAGE_BODY)
async def put_page(
    name: str, key: str, request: Request, ctx: Context = Depends(context)
) -> Response:
    created = await ctx.store.put_page(ref(ctx, request.scope, name), key, request.stream())
    return json({"stored": True, "created": created}, 201 if created else 200)


@router.get("/pages/{key}")
async def get_page(
    name: str, key: str, request: Request, ctx: Context = Depends(context)
) -> Response:
    page = await ctx.store.open_page(ref(ctx, request.scope, name), key)
    if page is None:
        raise KeyNotFound(f"page {key!r} is not in namespace {name!r}")
    return PageResponse(page)


class PageResponse(Response):
    """A page streamed from its pinned slot (sidecar/answers.py `PageAnswer`), one piece a
    loop turn: each is sent only once the one before has left the process (uvicorn waits
    while writing is paused), so an answer nobody reads holds one piece of memory and its
    slot (charged to the owner's ledger) until `--write-timeout`, and many answers share
    the loop's turns; the slot is given back however the answer ends (a client gone stops
    the copies at once)."""

    media_type = OCTETS

    def __init__(self, page: PageAnswer):
        super().__init__(media_type=OCTETS, headers={"content-length": str(page.size)})
        self.page = page

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            closing = scope.get(CLOSING_KEY, bool)
            for piece in () if scope["method"] == "HEAD" else self.page.pieces():
                if closing():  # the client went away (or timed out): nothing more to copy
                    return
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                await asyncio.sleep(0)  # one piece a loop turn: many answers share turns
            await send({"type": "http.response.body", "body": b""})
        finally:
            self.page.close()


@router.post("/prefetch", openapi_extra=body("keys"))
async def prefetch(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    return json(await ctx.store.prefetch(ref(ctx, request.scope, name), body.get("keys")))
