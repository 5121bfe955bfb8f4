"""Import SGLang's storage interface from the released `sglang` package (installed with
--no-deps) without running `sglang/__init__.py`, which pulls the whole serving stack
(transformers, torchvision, triton kernels: no CPU build here). Only the storage modules
and what they import are loaded: these are SGLang's own classes, not copies."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import pytest


def _root() -> str:
    loaded = sys.modules.get("sglang")
    if loaded is not None:
        return list(loaded.__path__)[0]
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        if os.environ.get("KV_SIDECAR_REQUIRE_SGLANG"):
            raise RuntimeError("sglang is not installed (make install puts it in .venv)")
        pytest.skip("sglang is not installed")
    return spec.submodule_search_locations[0]


def load(module: str = "sglang.srt.mem_cache.hicache_storage"):
    root = _root()
    for name, path in (("sglang", root), ("sglang.srt", os.path.join(root, "srt"))):
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [path]
            sys.modules[name] = stub
    return importlib.import_module(module)


def _stub_storage_package() -> None:
    """`sglang.srt.mem_cache.storage/__init__` imports every storage backend: skip it."""
    name = "sglang.srt.mem_cache.storage"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.__path__ = [os.path.join(_root(), "srt", "mem_cache", "storage")]
        sys.modules[name] = stub


def load_factory():
    """SGLang's own StorageBackendFactory (it imports only hicache_storage)."""
    load()
    _stub_storage_package()
    return importlib.import_module("sglang.srt.mem_cache.storage.backend_factory").StorageBackendFactory


def load_file_backend():
    """SGLang's HiCacheFile with its real LRUFileEvictor. The evictor imports one helper,
    `human_readable_int`, from sglang.srt.utils.common, whose module imports the serving
    stack; that one function is taken from the installed common.py by `ast`, unchanged."""
    h = load()
    if "sglang.srt.utils.common" not in sys.modules:
        import ast
        root = _root()
        path = os.path.join(root, "srt", "utils", "common.py")
        tree = ast.parse(open(path).read())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "human_readable_int")
        common = types.ModuleType("sglang.srt.utils.common")
        module = ast.fix_missing_locations(ast.Module([ast.Import([ast.alias("re")]), fn], []))
        exec(compile(module, path, "exec"), common.__dict__)
        if "sglang.srt.utils" not in sys.modules:
            stub = types.ModuleType("sglang.srt.utils")
            stub.__path__ = [os.path.join(root, "srt", "utils")]
            sys.modules["sglang.srt.utils"] = stub
        sys.modules["sglang.srt.utils.common"] = common
    _stub_storage_package()
    importlib.import_module("sglang.srt.mem_cache.storage.file.lru_file_evictor")
    return h.HiCacheFile
