"""Namespace specs: one model x one pool kind x one layout x one rank scope."""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field
from typing import Any, overload

import orjson

from sidecar.errors import BadRequest

POOL_KINDS = (
    "kv",
    "mamba",
    "swa",
    "indexer",
    "draft",
    "draft_indexer",
    "draft_swa",
    "deepseek_v4_c4",
    "deepseek_v4_c4_indexer",
    "deepseek_v4_c128",
    "deepseek_v4_c4_state",
    "deepseek_v4_c4_indexer_state",
    "deepseek_v4_c128_state",
    # added by SGLang 0.5.23's PoolName
    "auxiliary_swa",
    "deepseek_v4_c1",
    "deepseek_v4_c1_indexer",
    "deepseek_v4_c1_indexer_scale",
    "deepseek_v4_c2",
    "deepseek_v4_c2_indexer",
    "deepseek_v4_c2_indexer_scale",
    "deepseek_v4_c4_indexer_scale",
    "deepseek_v4_c4_rope",
    "deepseek_v4_c128_rope",
)
MIN_PAGE_BYTES = 512  # the index costs about the same per page whatever its size
_NAME = re.compile(r"[0-9A-Za-z_.:\-]{1,128}")
_RANK_FIELDS = ("tp", "tp_size", "pp", "pp_size", "cp", "cp_size")
_FIELDS = {
    "page_bytes",
    "pool",
    "model",
    "layout",
    "dtype",
    "page_tokens",
    "rank",
    "replicated",
    "host_capacity_bytes",
    "share_scope",
    "share_gid",
    "key_format",
}
KEY_FORMATS = ("", "vllm", "sglang")  # how KV events name a page (sidecar/events.py)


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise BadRequest(
            f"namespace name {name[:140]!r} must be 1-128 characters of [0-9A-Za-z_.:-]"
        )
    return name


@dataclass(frozen=True, slots=True)
class Rank:
    tp: int = 0
    tp_size: int = 1
    pp: int = 0
    pp_size: int = 1
    cp: int = 0
    cp_size: int = 1


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """What a namespace holds. Two registrations match when their specs are equal."""

    page_bytes: int
    pool: str = "kv"
    model: str = ""
    layout: str = "page_first"
    dtype: str = ""
    page_tokens: int = 0
    rank: Rank = field(default_factory=Rank)
    replicated: bool = False
    host_capacity_bytes: int | None = None
    share_scope: str = ""  # namespaces naming the same scope share tier pages
    share_gid: int | None = None  # peers in this group may use it too (sidecar/tenancy.py)
    key_format: str = ""  # how KV events name its pages: "vllm", "sglang", "" (the key)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def identity(self, name: str, owner: str) -> str:
        """A digest of what makes pages interchangeable: equal on every node and process.

        The namespace `name` is part of it (or, when set, the `share_scope` that several
        names agree on), and so is its `owner` (`tenancy.owner_tag`: the uid, the share
        group, or the operator), so tenants' namespaces never share tier pages by having
        equal specs or names. Capacity is not; a replicated pool's TP rank is always 0
        (see parse_spec).
        """
        data = self.to_json()
        data.pop("host_capacity_bytes")
        data.pop("key_format")  # what events call a page, not what the page is
        data["owner"] = owner
        if not self.share_scope:
            data["name"] = name
        return hashlib.sha256(orjson.dumps(data, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


@overload
def _int(body: dict, name: str, default: int, minimum: int) -> int: ...
@overload
def _int(body: dict, name: str, default: None, minimum: int) -> int | None: ...


def _int(body: dict, name: str, default: int | None, minimum: int) -> int | None:
    """`body[name]`, an integer >= `minimum`, or `default` when absent (None stays None)."""
    value = body.get(name, default)
    if value is None and default is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequest(f"'{name}' must be an integer >= {minimum}")
    return value


def _str(body: dict, name: str, default: str) -> str:
    value = body.get(name, default)
    if not isinstance(value, str) or len(value) > 256:
        raise BadRequest(f"'{name}' must be a string of at most 256 characters")
    return value


def _rank(value: Any) -> Rank:
    if value is None:
        return Rank()
    if not isinstance(value, dict) or set(value) - set(_RANK_FIELDS):
        raise BadRequest(f"'rank' must be an object with keys from {list(_RANK_FIELDS)}")
    vals = {
        k: _int(value, k, 1 if k.endswith("_size") else 0, 1 if k.endswith("_size") else 0)
        for k in _RANK_FIELDS
    }
    for dim in ("tp", "pp", "cp"):
        if vals[dim] >= vals[dim + "_size"]:
            raise BadRequest(f"rank.{dim} must be < rank.{dim}_size")
    return Rank(**vals)


def parse_spec(body: Any) -> NamespaceSpec:
    """Validate a PUT /v1/namespaces/{name} body; raise BadRequest naming the bad field."""
    if not isinstance(body, dict):
        raise BadRequest("namespace spec must be a JSON object")
    unknown = set(body) - _FIELDS
    if unknown:
        raise BadRequest(f"unknown namespace fields {sorted(unknown)}; known: {sorted(_FIELDS)}")
    if "page_bytes" not in body:
        raise BadRequest("'page_bytes' is required")
    pool = body.get("pool", "kv")
    if pool not in POOL_KINDS:
        raise BadRequest(f"'pool' must be one of {list(POOL_KINDS)}, got {str(pool)[:64]!r}")
    replicated = body.get("replicated", False)
    if not isinstance(replicated, bool):
        raise BadRequest("'replicated' must be true or false")
    rank = _rank(body.get("rank"))
    if replicated:  # identical on every TP rank: one namespace, whichever rank registers it
        rank = Rank(0, rank.tp_size, rank.pp, rank.pp_size, rank.cp, rank.cp_size)
    return NamespaceSpec(
        page_bytes=_int(body, "page_bytes", 0, MIN_PAGE_BYTES),
        pool=pool,
        model=_str(body, "model", ""),
        layout=_str(body, "layout", "page_first"),
        dtype=_str(body, "dtype", ""),
        page_tokens=_int(body, "page_tokens", 0, 0),
        rank=rank,
        replicated=replicated,
        host_capacity_bytes=_int(body, "host_capacity_bytes", None, 1),
        share_scope=_str(body, "share_scope", ""),
        share_gid=_int(body, "share_gid", None, 0),
        key_format=_key_format(body.get("key_format", "")),
    )


def _key_format(value: Any) -> str:
    if value not in KEY_FORMATS:
        raise BadRequest(f"'key_format' must be one of {list(KEY_FORMATS)}")
    return value
