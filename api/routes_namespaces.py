"""Namespaces and their engine buffers."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import Response

from api.deps import context, ref, who
from api.openapi import body
from api.wire import json, read_json
from sidecar.context import Context
from sidecar.namespace import Namespace
from sidecar.peer import scope_peer
from sidecar.spec import parse_spec
from sidecar.tenancy import owner_uid

router = APIRouter(prefix="/v1/namespaces")


def _describe(ctx: Context, ns: Namespace, request: Request) -> dict:
    """A namespace, by the name its caller knows it by, with its owner (a uid; None: made
    on TCP, by the operator or anonymously) and the buffers the caller registered on the
    engine socket. A buffer registered on TCP (cuda_ipc) is never listed: its id is the
    capability."""
    peer = scope_peer(request.scope)
    return {
        "name": ctx.store.dir.label(ns, who(ctx, request.scope)),
        "owner": owner_uid(ns.owner),
        "spec": ns.spec.to_json(),
        "identity": ns.identity,
        "buffers": [
            b.describe()
            for b in ns.buffers.values()
            if b.owner_uid is not None and b.usable_by(peer)
        ],
    }


@router.get("")
async def list_namespaces(request: Request, ctx: Context = Depends(context)) -> Response:
    return json(
        {
            "namespaces": [
                _describe(ctx, ns, request) for ns in ctx.store.dir.visible(who(ctx, request.scope))
            ]
        }
    )


@router.put("/{name}", openapi_extra=body("namespace"))
async def put_namespace(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    spec = parse_spec(await read_json(request, ctx.config.max_json_body))
    ns, created = ctx.store.put_namespace(name, spec, who(ctx, request.scope))
    return json(_describe(ctx, ns, request), 201 if created else 200)


@router.get("/{name}")
async def get_namespace(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    return json(_describe(ctx, ctx.store.namespace(ref(ctx, request.scope, name)), request))


@router.delete("/{name}")
async def delete_namespace(
    name: str, request: Request, ctx: Context = Depends(context)
) -> Response:
    ns = await ctx.store.drop_namespace(ref(ctx, request.scope, name), who(ctx, request.scope))
    failed = await ctx.store.drop_tiers(ns)
    return json({"deleted": name, "failed": failed})


@router.post("/{name}/buffers", openapi_extra=body("buffer"))
async def register_buffer(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    body = await read_json(request, ctx.config.max_json_body)
    buf = await ctx.store.register_buffer(
        ref(ctx, request.scope, name), body, scope_peer(request.scope)
    )
    return json({"buffer_id": buf.id}, 201)


@router.get("/{name}/buffers")
async def list_buffers(name: str, request: Request, ctx: Context = Depends(context)) -> Response:
    ns = ctx.store.namespace(ref(ctx, request.scope, name))
    return json({"buffers": _describe(ctx, ns, request)["buffers"]})


@router.delete("/{name}/buffers/{buffer_id}")
async def release_buffer(
    name: str, buffer_id: str, request: Request, ctx: Context = Depends(context)
) -> Response:
    ctx.store.release_buffer(ref(ctx, request.scope, name), buffer_id, scope_peer(request.scope))
    return json({"released": buffer_id})
