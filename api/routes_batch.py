"""Several pools at once: batch exists / set / get (hybrid models)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import Response

from api import fastpath
from api.deps import context, who
from api.openapi import body
from api.wire import json, raw_json, read_json
from sidecar import hybrid
from sidecar.context import Context
from sidecar.errors import BadRequest
from sidecar.peer import scope_peer

router = APIRouter(prefix="/v1/batch")


@router.post("/exists", openapi_extra=body("batch_exists"))
async def batch_exists(request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    return raw_json(await fastpath.batch_exists(ctx, request.scope, None, body))


@router.post("/set", openapi_extra=body("batch_move"))
async def batch_set(request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    return json(
        {
            "stored": await hybrid.batch_set(
                ctx.store, body.get("items"), scope_peer(request.scope), who(ctx, request.scope)
            )
        }
    )


@router.post("/get", openapi_extra=body("batch_move"))
async def batch_get(request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    kv = body.get("kv")
    if kv is not None and not isinstance(kv, str):
        raise BadRequest("'kv' must name the KV namespace of the items")
    return json(
        {
            "loaded": await hybrid.batch_get(
                ctx.store, body.get("items"), kv, scope_peer(request.scope), who(ctx, request.scope)
            )
        }
    )
