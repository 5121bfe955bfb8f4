"""Stable import path for SGLang's `--unified-cache-external-linker-backend dynamic` config
(`"linker_module_path": "api.sglang_linker"`); the code lives in `api.engine.sglang_linker`."""

from api.engine.sglang_linker import SidecarLinker

__all__ = ["SidecarLinker"]
