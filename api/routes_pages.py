"""Pages of one namespace: exists, set, get, delete, and inline octet-stream pages."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import Response

from api import fastpath
from api.deps import context, ref
from api.openapi import PAGE_BODY, body
from api.wire import flag, json, raw_json, read_json
from sidecar.context import Context
from sidecar.errors import KeyNotFound

router = APIRouter(prefix="/v1/namespaces/{name}")
OCTETS = "application/octet-stream"


@router.post("/exists", openapi_extra=body("keys"))
async def exists(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    if flag(request, "each"):
        return json({"present": await ctx.store.present(ref(ctx, request.scope, name),
                                                        body.get("keys"))})
    return raw_json(await fastpath.exists(ctx, request.scope, name, body))


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
async def put_page(name: str, key: str, request: Request, ctx: Context = Depends(context)) -> Response:
    created = await ctx.store.put_page(ref(ctx, request.scope, name), key, request.stream())
    return json({"stored": True, "created": created}, 201 if created else 200)


@router.get("/pages/{key}")
async def get_page(name: str, key: str, request: Request, ctx: Context = Depends(context)) -> Response:
    page = await ctx.store.read_page(ref(ctx, request.scope, name), key)
    if page is None:
        raise KeyNotFound(f"page {key!r} is not in namespace {name!r}")
    return Response(memoryview(page), media_type=OCTETS)


@router.post("/prefetch", openapi_extra=body("keys"))
async def prefetch(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    return json(await ctx.store.prefetch(ref(ctx, request.scope, name), body.get("keys")))
