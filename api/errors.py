"""The one table from domain errors to HTTP statuses, and the error body of API.md."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from sidecar import errors as e

log = logging.getLogger("kv_sidecar.api")

STATUS: dict[type, int] = {
    e.BadRequest: 400,
    e.Unauthorized: 401,
    e.Forbidden: 403,
    e.NotFound: 404,
    e.Conflict: 409,
    e.PayloadTooLarge: 413,
    e.GeometryMismatch: 422,
    e.TooMany: 429,
    e.TransportUnavailable: 422,
    e.NotReady: 503,
    e.NoRoom: 507,
    e.PinBound: 507,
}
_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    400: "bad_request",
    413: "payload_too_large",
}


def status_for(exc: e.SidecarError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_body(code: str, message: str, **extra) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message, **extra}})


def error_response(status: int, code: str, message: str, **extra) -> Response:
    return Response(error_body(code, message, **extra), status, media_type="application/json")


async def on_domain_error(request: Request, exc: e.SidecarError) -> Response:
    return error_response(status_for(exc), exc.code, exc.message, **exc.extra)


async def on_http_error(request: Request, exc: HTTPException) -> Response:
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail))


async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()))
    return error_response(400, "bad_request", f"{where}: {first.get('msg', 'invalid request')}")


async def on_disconnect(request: Request, exc: ClientDisconnect) -> Response:
    """The client went away mid-body; whatever was reserved is already aborted."""
    return error_response(400, "client_disconnected", "the client closed the connection")


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal", "internal error; see the sidecar log")


# each handler takes the class it is keyed by (which a dict's type cannot say: Any)
HANDLERS: dict[type[Exception], Callable[[Request, Any], Awaitable[Response]]] = {
    e.SidecarError: on_domain_error,
    HTTPException: on_http_error,
    RequestValidationError: on_validation_error,
    ClientDisconnect: on_disconnect,
    Exception: on_unexpected,
}
