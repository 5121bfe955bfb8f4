"""`make gpu-wheels` (scripts/gpu_wheels.py): the wheels a bare GPU machine needs resolve
against its image and fit a device call (issue 46)."""

import importlib.util
import pathlib
import shutil
import tomllib

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location(
    "gpu_wheels", pathlib.Path(ROOT) / "scripts" / "gpu_wheels.py"
)
gw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gw)


def test_the_lock_covers_what_the_server_needs_beside_the_image():
    lock, image = gw.locked(), {gw.canonicalize_name(n) for n in gw.IMAGE}
    deps = tomllib.loads((pathlib.Path(ROOT) / "pyproject.toml").read_text())["project"][
        "dependencies"
    ]
    missing = [
        d
        for d in map(gw.Requirement, deps)
        if gw.canonicalize_name(d.name) not in lock and gw.canonicalize_name(d.name) not in image
    ]
    assert missing == []
    assert "torch" not in lock and not set(lock) & {
        "cuda-bindings",
        "numpy",
        "pytest",
    }  # the image's


@pytest.mark.parametrize(
    "name, ok",
    [
        ("orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
        ("fastapi-0.165.0-py3-none-any.whl", True),
        ("x-1.0-cp38-abi3-manylinux_2_17_x86_64.whl", True),
        ("orjson-3.13.0-cp311-cp311-manylinux_2_17_x86_64.whl", False),
        ("orjson-3.13.0-cp312-cp312-manylinux_2_17_aarch64.whl", False),
        ("orjson-3.13.0-cp312-cp312-macosx_11_0_arm64.whl", False),
        ("x-1.0-cp312-cp312-musllinux_1_2_x86_64.whl", False),
    ],
)
def test_only_wheels_for_cpython_312_on_x86_64_linux_pass(name, ok):
    assert gw.installable(name) is ok


@pytest.mark.slow
def test_the_downloaded_set_resolves_and_fits_and_a_broken_one_is_named(scratch):
    """Downloads the lock (network, about 4.5 MiB), checks it, then breaks copies of it."""
    dest = pathlib.Path(scratch(prefix="whl-")) / "whl"
    gw.download(dest)
    assert gw.check(dest) == []
    assert "MiB of 64" in gw.summary(dest)
    core = next(dest.glob("pydantic_core-*.whl"))
    lacking = pathlib.Path(scratch(prefix="whl-"))
    for w in dest.glob("*.whl"):
        if w != core:
            shutil.copy(w, lacking)
    assert any(
        "pydantic-core" in p and "neither in the set nor in the GPU image" in p
        for p in gw.check(lacking)
    )
    twice = pathlib.Path(scratch(prefix="whl-"))
    for w in dest.glob("*.whl"):
        shutil.copy(w, twice)
    shutil.copy(core, twice / core.name.replace("2.50.5", "2.50.4"))
    assert any("two versions of pydantic-core" in p for p in gw.check(twice))
