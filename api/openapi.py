"""Request-body schemas for the OpenAPI document. The routes parse bodies themselves
(orjson, on the hot path), so FastAPI cannot infer these; they are declared here so the
schema describes the contract (and schemathesis can exercise it)."""

from __future__ import annotations

from sidecar.spec import POOL_KINDS

KEY = {"type": "string", "pattern": "^[0-9A-Za-z_.:-]{1,128}$"}
KEYS = {"type": "array", "items": KEY, "maxItems": 4096}
UINT = {"type": "integer", "minimum": 0}
SLOTS = {"type": "array", "items": UINT}
CHUNK = {
    "type": "object",
    "required": ["offset", "stride", "size"],
    "properties": {"offset": UINT, "stride": UINT, "size": {"type": "integer", "minimum": 1}},
}
RANK = {
    "type": "object",
    "properties": {k: UINT for k in ("tp", "tp_size", "pp", "pp_size", "cp", "cp_size")},
}


def _obj(required: list[str], **props) -> dict:
    return {"type": "object", "required": required, "properties": props}


SCHEMAS = {
    "keys": _obj(["keys"], keys=KEYS),
    "exists": _obj(["keys"], keys=KEYS, where={"type": "boolean"}),
    "skipped": _obj(
        [],
        loads={"type": "integer", "minimum": 0, "maximum": 4096},
        pages={"type": "integer", "minimum": 0, "maximum": 4096 * 4096},
    ),
    "move": _obj(
        ["keys", "buffer_id", "slots"],
        keys=KEYS,
        buffer_id={"type": "string"},
        slots=SLOTS,
        durable={"type": "boolean"},
    ),
    "namespace": _obj(
        ["page_bytes"],
        page_bytes={"type": "integer", "minimum": 1},
        pool={"enum": list(POOL_KINDS)},
        model={"type": "string"},
        layout={"type": "string"},
        dtype={"type": "string"},
        page_tokens=UINT,
        rank=RANK,
        replicated={"type": "boolean"},
        host_capacity_bytes={"type": "integer", "minimum": 1},
    ),
    "buffer": _obj(
        ["transport", "size", "slots", "chunks"],
        transport={"enum": ["shm", "cuda_ipc"]},
        size={"type": "integer", "minimum": 1},
        slots={"type": "integer", "minimum": 1},
        chunks={"type": "array", "items": CHUNK, "minItems": 1},
        path={"type": "string"},
        pid={"type": "integer", "minimum": 1},
        fd=UINT,
        handle={"type": "string"},
        offset=UINT,
        device_uuid={"type": "string"},
    ),
    "select": {
        "type": "object",
        "properties": {  # operator controls: keys, or a chain from a key
            "keys": KEYS,
            "chain": KEYS,
            "from": KEY,
            "all": {"type": "boolean"},
            "ttl": {"type": "number", "exclusiveMinimum": 0, "maximum": 604800},
        },
    },
    "batch_exists": _obj(
        ["keys", "kv"],
        keys=KEYS,
        kv={"type": "string"},
        extra={
            "type": "array",
            "items": _obj(
                ["namespace"],
                namespace={"type": "string"},
                policy={"enum": ["all_pages", "trailing_pages"]},
                window={"type": "integer", "minimum": 1},
            ),
        },
        restorable={"type": "boolean"},
    ),
    "batch_move": _obj(
        ["items"],
        kv={"type": "string"},
        items={
            "type": "array",
            "items": _obj(
                ["namespace", "keys", "buffer_id", "slots"],
                namespace={"type": "string"},
                keys=KEYS,
                buffer_id={"type": "string"},
                slots=SLOTS,
            ),
        },
    ),
}


def body(name: str) -> dict:
    """`openapi_extra` for a route taking the JSON body `name`."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": SCHEMAS[name]}},
        }
    }


PAGE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
