"""The server needs no torch: torch is the `engine` extra (api/engine/ imports it).

Each check runs the server side in a child process whose import system refuses `torch`: a
meta-path finder raising ModuleNotFoundError, installed by a `sitecustomize` on PYTHONPATH
before anything else is imported. Not a fresh virtualenv without torch: that would need a
network install of every server dependency on each run, where the finder is hermetic,
takes a second, and also catches an import of torch deferred to run time (the requests
served below). The package metadata, the other half of "installs without torch", is read
from pyproject.toml.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.procs import SidecarProcess
from tests.conftest import ROOT

BLOCKER = """import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("torch is blocked: the server must not import it", name=name)
        return None
sys.meta_path.insert(0, _NoTorch())
"""


@pytest.fixture
def no_torch(tmp_path) -> dict:
    """The environment of a child process that cannot import torch."""
    site = tmp_path / "no-torch"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": str(site)}


def engine_shim(path: pathlib.Path) -> bool:
    """A module of api/ that re-exports api/engine/ code: a stable import path engine
    configs name (api.sglang_backend, api.vllm_connector), engine side."""
    tree = ast.parse(path.read_text())
    return any(
        isinstance(n, ast.ImportFrom) and (n.module or "").startswith("api.engine")
        for n in tree.body
    )


def server_modules() -> list[str]:
    """Every module of sidecar/, pools/ and api/ but api/engine/ and the engine shims."""
    root, out = pathlib.Path(ROOT), []
    for pkg in ("sidecar", "pools", "api"):
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            if rel.parts[:2] == ("api", "engine") or engine_shim(path) or rel.name == "__main__":
                continue  # (__main__ runs the CLI: test_served_without_torch runs it)
            out.append(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    return out


def run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_every_server_module_imports_without_torch(no_torch):
    mods = server_modules()
    assert {
        "sidecar.server",
        "sidecar.metrics",
        "pools.page_pool",
        "api.app",
        "sidecar.tiers.file_tier",
        "sidecar.transports.cuda_ipc",
    } <= set(mods)
    assert not {"api.sglang_backend", "api.vllm_connector"} & set(mods)
    code = (
        "import importlib, sys\nbad = []\n"
        f"for m in {mods!r}:\n"
        "    try:\n        importlib.import_module(m)\n"
        "    except Exception as exc:\n        bad.append(f'{m}: {exc!r}')\n"
        "print('\\n'.join(bad) or 'ok', 'torch' in sys.modules)"
    )
    out = run(code, no_torch)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "False"], out.stdout


def test_the_blocker_blocks(no_torch):
    """The finder really refuses torch: the engine's shm helpers cannot import under it."""
    out = run("import api.engine.shm", no_torch)
    assert out.returncode != 0 and "torch is blocked" in out.stderr, out.stderr


def test_served_without_torch(no_torch, tmp_path):
    """`sidecar serve` under the finder: ready; pages set and got over shm (lent by an engine
    that has torch) and inline; metrics; exits 0 on SIGTERM, never having imported torch."""
    proc = SidecarProcess(
        "--host-pool", "64MiB", "--data-dir", str(tmp_path / "tier"), env=no_torch
    )
    try:
        proc.wait_ready()
        engine = SidecarClient(proc.socket_url)
        engine.put_namespace("kv", 4096, model="m")
        buf = SharedBuffer(4 * 4096)
        pages = buf.tensor((4, 4096))
        pages[:2] = 7
        bid = buf.register(engine, "kv", slots=4, chunks=page_first_chunks(4096))
        assert engine.set("kv", ["a", "b"], bid, [0, 1]) == [True, True]
        assert engine.get("kv", ["a", "b"], bid, [2, 3]) == [True, True]
        assert int(pages[2:].sum()) == 7 * 2 * 4096
        assert engine.put_page("kv", "c", b"x" * 4096) and engine.get_page("kv", "c") == b"x" * 4096
        assert re.search(r'kv_sidecar_hits_total\{namespace="kv"\} [1-9]', engine.metrics())
        assert SidecarClient(proc.url).health()["status"] == "ok"  # TCP too
        engine.close()
        buf.close()
        rc, log = proc.terminate()
    finally:
        proc.kill()
    assert rc == 0, log
    assert "torch is blocked" not in log and "Traceback" not in log, log


def test_torch_is_the_engine_extra_only():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("torch")]
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["engine"])
    with open(os.path.join(ROOT, "Makefile")) as f:
        make = f.read()
    # the test venv and both engine venvs still install it (their suites need torch)
    assert len(re.findall(r"\[test,loadtest,mooncake,plan,engine[],]", make)) == 1
    assert make.count("-e '.[test,engine]'") == 2


@pytest.mark.parametrize("mod", ["api.engine.shm", "api.engine.cuda_export"])
def test_engine_side_still_has_torch(mod):
    assert importlib.import_module(mod).torch.__version__
