"""Dependencies point one way: api -> sidecar -> pools. Only the CUDA transport touches CUDA."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def imports(package: str):
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                yield path.relative_to(ROOT).as_posix(), name.split(".")[0], name


def test_pools_import_neither_sidecar_nor_api():
    bad = [(f, n) for f, top, n in imports("pools") if top in ("sidecar", "api", "torch", "cuda")]
    assert bad == []


def test_sidecar_does_not_import_api():
    bad = [(f, n) for f, top, n in imports("sidecar") if top == "api"]
    assert bad == []


def test_only_cuda_ipc_touches_cuda():
    """In the sidecar, only the CUDA transport; on the engine side, only its exporter."""
    users = {f for pkg in ("pools", "sidecar", "api") for f, top, _ in imports(pkg) if top == "cuda"}
    assert users <= {"sidecar/transports/cuda_ipc.py", "api/engine/cuda_export.py"}


def test_files_stay_small():
    big = [p.name for pkg in ("pools", "sidecar", "api") for p in (ROOT / pkg).rglob("*.py")
           if len(p.read_text().splitlines()) > 600]
    assert big == []


def test_engine_side_imports_no_server_code():
    """An engine process imports api.engine only: never the routes, the sidecar or the pools."""
    bad = [(f, n) for f, top, n in imports("api/engine")
           if top in ("sidecar", "pools", "fastapi", "starlette", "uvicorn")
           or (top == "api" and not n.startswith("api.engine"))]
    assert bad == []
