"""Stand-ins for SGLang's storage interface types, used only where SGLang cannot be
imported (so `api.engine.sglang_backend` imports anywhere); inside SGLang the real ones are used."""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from enum import Enum


class PoolHitPolicy(str, Enum):  # noqa: UP042 (mirrors SGLang's class as-is; StrEnum's str() differs)
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


@dataclass
class PoolTransferResult:
    kv_hit_pages: int
    extra_pool_hit_pages: dict
    restorable_prefix_pages: list | None = None


class HiCacheStorage(ABC):  # noqa: B024 (an empty stand-in for SGLang's ABC, named as a base only)
    """The shape of sglang.srt.mem_cache.hicache_storage.HiCacheStorage."""
