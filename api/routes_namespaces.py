"""Namespaces and their engine buffers."""
from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import Response

from api.deps import context
from api.openapi import body
from api.wire import json, read_json
from sidecar.context import Context
from sidecar.peer import Peer, scope_peer
from sidecar.spec import parse_spec

router = APIRouter(prefix="/v1/namespaces")


def _describe(ctx: Context, name: str, peer: Optional[Peer]) -> dict:
    """A namespace; the buffers `peer` registered on the engine socket. A buffer registered
    on TCP (cuda_ipc) is never listed: its id is the capability."""
    ns = ctx.store.namespace(name)
    return {"name": name, "spec": ns.spec.to_json(), "identity": ns.identity,
            "buffers": [b.describe() for b in ns.buffers.values()
                        if b.owner_uid is not None and b.usable_by(peer)]}


@router.get("")
async def list_namespaces(request: Request, ctx: Context = Depends(context)) -> Response:
    peer = scope_peer(request.scope)
    return json({"namespaces": [_describe(ctx, n, peer) for n in ctx.store.namespaces]})


@router.put("/{name}", openapi_extra=body("namespace"))
async def put_namespace(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    spec = parse_spec(await read_json(request, ctx.config.max_json_body))
    created = ctx.store.put_namespace(name, spec)
    return json(_describe(ctx, name, scope_peer(request.scope)), 201 if created else 200)


@router.get("/{name}")
async def get_namespace(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    return json(_describe(ctx, name, scope_peer(request.scope)))


@router.delete("/{name}")
async def delete_namespace(name: str, ctx: Context = Depends(context)) -> Response:
    failed = await ctx.store.drop_tiers(ctx.store.delete_namespace(name))
    return json({"deleted": name, "failed": failed})


@router.post("/{name}/buffers", openapi_extra=body("buffer"))
async def register_buffer(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    buf = ctx.store.register_buffer(name, body, scope_peer(request.scope))
    return json({"buffer_id": buf.id}, 201)


@router.get("/{name}/buffers")
async def list_buffers(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    return json({"buffers": _describe(ctx, name, scope_peer(request.scope))["buffers"]})


@router.delete("/{name}/buffers/{buffer_id}")
async def release_buffer(name: str, buffer_id: str, request: Request,
                         ctx: Context = Depends(context)) -> Response:
    ctx.store.release_buffer(name, buffer_id, scope_peer(request.scope))
    return json({"released": buffer_id})
