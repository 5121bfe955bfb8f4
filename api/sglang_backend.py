"""Stable import path for SGLang's `--hicache-storage-backend dynamic` config
(`"module_path": "api.sglang_backend"`); the code lives in `api.engine.sglang_backend`."""

from api.engine.sglang_backend import SidecarHiCacheStorage

__all__ = ["SidecarHiCacheStorage"]
