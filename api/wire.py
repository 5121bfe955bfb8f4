"""Reading and writing wire bodies (orjson), with the size limits of the config."""
from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from sidecar.errors import BadRequest, PayloadTooLarge


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 400 for bad JSON, 413 past `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) <= limit:
        raw = await request.body()  # the guard holds the stream to its declared length
    else:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"JSON body is over {limit} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


def flag(request: Request, name: str) -> bool:
    """A boolean query parameter: 1/true/yes."""
    value = request.query_params.get(name)
    if value is None:
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no", ""):
        return False
    raise BadRequest(f"query parameter '{name}' must be 1 or 0")
