"""Health, readiness, metrics and stats."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import Response

from api.deps import context, observer, who
from api.errors import error_response
from api.wire import json, number
from sidecar import report
from sidecar.context import Context
from sidecar.errors import BadRequest
from sidecar.metrics import render, snapshot

router = APIRouter()


@router.get("/healthz")
async def healthz() -> Response:
    return json({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    ctx = getattr(request.app.state, "ctx", None)
    if ctx is None or not ctx.ready:
        return error_response(503, "not_ready", "pools are being allocated or tiers recovered")
    return json({"status": "ready"})


@router.get("/metrics")
async def metrics(request: Request, ctx: Context = Depends(context)) -> Response:
    snap = snapshot(ctx.store, ctx.requests, observer(ctx, request.scope))  # on the loop
    text = await asyncio.get_running_loop().run_in_executor(None, render, snap)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/stats")
async def stats(request: Request, ctx: Context = Depends(context)) -> Response:
    return json(
        {
            "uptime_s": round(time.time() - ctx.started, 3),
            "cuda_host_registered": ctx.cuda_registered,
            "loop": ctx.monitor.describe(),
            "ledger": ctx.store.ledger.describe(),
            **report.stats(ctx.store, observer(ctx, request.scope)),
        }
    )


@router.post("/v1/flush")
async def flush(request: Request, ctx: Context = Depends(context)) -> Response:
    timeout = number(request, "timeout", "60", "a number of seconds")
    if not 0 <= timeout <= 3600:
        raise BadRequest("'timeout' must be between 0 and 3600 seconds")
    pending = await ctx.flush(timeout, who(ctx, request.scope))
    failed = ctx.store.tiering.writer.failed if ctx.store.tiering.writer else 0
    return json({"pending": pending, "failed": failed}, 200 if pending == 0 else 504)


@router.get("/v1/prefetch/{ticket}")
async def prefetch_state(ticket: str, ctx: Context = Depends(context)) -> Response:
    return json(ctx.store.ticket(ticket))
