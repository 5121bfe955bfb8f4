"""Dependencies point one way: loadtest -> api -> sidecar -> pools, with no circles anywhere
in the repository (tests and tools too), and a module named in a string counts as an
import. Tests stand above the tools: `tests -> loadtest`, never back; inside loadtest/ the
tools' floor (loadtest/kit/) imports no other tool. Only the CUDA transport touches CUDA."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def imports_of(path: pathlib.Path):
    """(file, top package, module) of every absolute import in `path` (type-only ones too);
    `from a.b import c` also yields `a.b.c`, which is a module where c is one."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            yield path.relative_to(ROOT).as_posix(), name.split(".")[0], name


def imports(package: str):
    for path in (ROOT / package).rglob("*.py"):
        yield from imports_of(path)


def test_pools_import_neither_sidecar_nor_api():
    bad = [(f, n) for f, top, n in imports("pools") if top in ("sidecar", "api", "torch", "cuda")]
    assert bad == []


def test_sidecar_does_not_import_api():
    bad = [(f, n) for f, top, n in imports("sidecar") if top == "api"]
    assert bad == []


def test_product_never_imports_loadtest_or_tests():
    """No import statement in api/, sidecar/ or pools/ names loadtest or tests: at the top of
    a file, in a function (the replay command once imported its quantile from the bench
    there), or behind `if TYPE_CHECKING`."""
    bad = [
        (f, n)
        for pkg in ("pools", "sidecar", "api")
        for f, top, n in imports(pkg)
        if top in ("loadtest", "tests")
    ]
    assert bad == []


def test_tools_never_import_tests():
    """loadtest/ runs from a checkout without tests/: what both need lives in loadtest/kit/
    (the benches once imported the vLLM engine kit from tests/, a circle of packages)."""
    bad = [(f, n) for f, top, n in imports("loadtest") if top == "tests"]
    bad += [(f, n) for f, n in strings_in("loadtest") if n.startswith("tests.")]
    assert bad == []


def test_the_tools_floor_imports_no_tool():
    """loadtest/kit/ is the floor the benches, the red team, the chaos soak and the tests
    stand on: it imports the product and nothing else of loadtest/."""
    bad = [
        (f, n)
        for f, top, n in imports("loadtest/kit")
        if top == "loadtest" and not n.startswith("loadtest.kit")
    ]
    assert bad == []


def test_only_cuda_ipc_touches_cuda():
    """In the sidecar, only the CUDA transport; on the engine side, only its exporter."""
    users = {
        f for pkg in ("pools", "sidecar", "api") for f, top, _ in imports(pkg) if top == "cuda"
    }
    assert users <= {"sidecar/transports/cuda_ipc.py", "api/engine/cuda_export.py"}


def test_files_stay_small():
    big = [
        p.name
        for pkg in ("pools", "sidecar", "api", "loadtest")
        for p in (ROOT / pkg).rglob("*.py")
        if len(p.read_text().splitlines()) > 600
    ]
    assert big == []


def test_engine_side_imports_no_server_code():
    """An engine process imports api.engine only: never the routes, the sidecar or the pools."""
    bad = [
        (f, n)
        for f, top, n in imports("api/engine")
        if top in ("sidecar", "pools", "fastapi", "starlette", "uvicorn")
        or (top == "api" and not n.startswith("api.engine"))
    ]
    assert bad == []


MODULE_NAME = re.compile(r"(?:pools|sidecar|api|loadtest|tests)(?:\.\w+)+")
PACKAGES = ("pools", "sidecar", "api", "loadtest", "tests")  # the repository's, top to bottom


def modules() -> dict[str, pathlib.Path]:
    """Every module of the repository's packages by dotted name."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def strings_in(package: str):
    """(file, module) for every module name a file of `package` holds as a string."""
    for path in (ROOT / package).rglob("*.py"):
        for name in named_by_string(path):
            yield path.relative_to(ROOT).as_posix(), name


def named_by_string(path: pathlib.Path):
    """Module names a file holds as strings (an import by name: `importlib.import_module`,
    a uvicorn `module:attr`), where they name a module of this project."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value.split(":")[0]
            if MODULE_NAME.fullmatch(name) and (ROOT / (name.replace(".", "/") + ".py")).exists():
                yield name


# The imports by name allowed upward: the composition roots, where the server process
# builds its app (sidecar/server.py names `api.app:create_app`; the sidecar cannot import the
# routes, which import it) and `python -m sidecar` runs the one CLI (`api.cli`).
COMPOSITION_ROOT = {("sidecar/server.py", "api.app"), ("sidecar/__main__.py", "api.cli")}


def test_no_upward_import_by_string():
    """Floors are `loadtest -> api -> sidecar -> pools`: a module named as a string counts as
    an import (the CLI once loaded `loadtest.replay` by name from the sidecar)."""
    floor = {"pools": 0, "sidecar": 1, "api": 2, "loadtest": 3}
    bad = []
    for pkg in ("pools", "sidecar", "api"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            for name in named_by_string(path):
                if floor[name.split(".")[0]] > floor[pkg] and (rel, name) not in COMPOSITION_ROOT:
                    bad.append((rel, name))
    assert bad == []


def test_no_import_circles():
    """No module of the repository (product, tools, tests) imports, directly or through
    others (type-only imports and names in strings included), a module that imports it
    back."""
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        rel = path.relative_to(ROOT).as_posix()
        edges[m] |= {name for _, _, name in imports_of(path) if name in mods and name != m}
        edges[m] |= {
            n for n in named_by_string(path) if n in mods and (rel, n) not in COMPOSITION_ROOT
        }
    assert circles(edges) == []


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out
