"""Stand-ins for SGLang's storage interface types, used only where SGLang cannot be
imported (so `api.engine.sglang_backend` imports anywhere); inside SGLang the real ones are used."""
from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from enum import Enum
from typing import Optional


class PoolHitPolicy(str, Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


@dataclass
class PoolTransferResult:
    kv_hit_pages: int
    extra_pool_hit_pages: dict
    restorable_prefix_pages: Optional[list] = None


class HiCacheStorage(ABC):
    """The shape of sglang.srt.mem_cache.hicache_storage.HiCacheStorage."""
