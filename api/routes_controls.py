"""Operators' controls (sidecar/controls/): pin, unpin, evict and warm pages by keys or by
chain, pins listed, warm jobs followed, and what a cached token costs."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import Response

from api.deps import context, observer, ref, who
from api.openapi import body
from api.wire import json, read_json
from sidecar import cost
from sidecar.context import Context
from sidecar.controls import select, ttl_of

router = APIRouter()
NS = "/v1/namespaces/{name}"


@router.post(NS + "/pin", openapi_extra=body("select"))
async def pin(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    sel, ttl = select(body), ttl_of(body)
    return json(
        await ctx.store.controls.pin(
            ref(ctx, request.scope, name), who(ctx, request.scope), sel, ttl
        )
    )


@router.post(NS + "/unpin", openapi_extra=body("select"))
async def unpin(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    sel = None if body.get("all") is True else select(body)
    return json(
        await ctx.store.controls.unpin(ref(ctx, request.scope, name), who(ctx, request.scope), sel)
    )


@router.get(NS + "/pins")
async def pins(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    return json(
        ctx.store.controls.listing(ref(ctx, request.scope, name), who(ctx, request.scope), name)
    )


@router.get("/v1/pins")
async def all_pins(request: Request, ctx: Context = Depends(context)) -> Response:
    return json(ctx.store.controls.summary(who(ctx, request.scope)))


@router.post(NS + "/evict", openapi_extra=body("select"))
async def evict(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    return json(
        await ctx.store.controls.evict(
            ref(ctx, request.scope, name), who(ctx, request.scope), select(body)
        )
    )


@router.post(NS + "/warm", openapi_extra=body("select"))
async def warm(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    return json(
        await ctx.store.controls.warm(
            ref(ctx, request.scope, name), who(ctx, request.scope), select(body)
        ),
        202,
    )


@router.get("/v1/warm/{job}")
async def warm_state(job: str, request: Request, ctx: Context = Depends(context)) -> Response:
    return json(ctx.store.controls.job(job, who(ctx, request.scope)))


@router.get("/v1/cost")
async def cost_now(request: Request, ctx: Context = Depends(context)) -> Response:
    return json(cost.measure(ctx.store, observer(ctx, request.scope)))
