"""Reading and writing wire bodies (orjson), with the size limits of the config."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from sidecar.errors import BadRequest, PayloadTooLarge


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 400 for bad JSON, 413 past `limit` bytes."""
    return parse_object(await receive_body(request.receive, limit))


# What a parse costs is set by the values it creates (a list ~200 ns, a short string ~70 ns),
# not by the bytes: 16 MiB of `[],` took 1.8 s. A body past COUNT_FROM bytes has its
# structural bytes counted as it arrives (a C pass, ~0.5 ms/MiB); past MAX_JSON_VALUES it is
# refused before any parse, which bounds every parse to ~12 ms (4 MiB of 128-byte strings);
# an uncounted body (<= COUNT_FROM) parses in at most ~14 ms (128 KiB of `[],`).
COUNT_FROM = (
    128 * 1024
)  # above an exists of 1,000 64-char keys (67 KB): the count costs ~58 us there
MAX_JSON_VALUES = 1 << 15  # "," "[" "{" in a body; the largest single-route request has ~8,200
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b",[{")


async def receive_body(receive, limit: int) -> bytes:
    """The whole request body from an ASGI `receive`; 413 past `limit` bytes or past
    MAX_JSON_VALUES values."""
    chunks, size, counted, values, more = [], 0, 0, 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"JSON body is over {limit} bytes")
        chunks.append(chunk)
        if size > COUNT_FROM:
            values += sum(len(c.translate(None, _NOT_STRUCTURAL)) for c in chunks[counted:])
            counted = len(chunks)
            if values > MAX_JSON_VALUES:
                raise PayloadTooLarge(f"JSON body holds over {MAX_JSON_VALUES} values")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_object(raw: bytes) -> dict[str, Any]:
    """One orjson parse; 400 unless it is a JSON object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def json(data: Any, status: int = 200) -> Response:
    return raw_json(orjson.dumps(data), status)


def raw_json(data: bytes, status: int = 200) -> Response:
    return Response(data, status, media_type="application/json")


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


def number(request: Request, name: str, default: str, what: str) -> float:
    """A float query parameter; 400 naming `what` it must be."""
    raw = request.query_params.get(name, default)
    try:
        return float(raw)
    except ValueError:
        raise BadRequest(f"'{name}' must be {what}, got {raw[:20]!r}") from None
