"""What ships (issue 56): the wheel packages the product (`sidecar`, `api`, `pools`) and the
image copies nothing else; the tools (loadtest/: benches, red team, chaos soak) and the
tests need a checkout."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = {"sidecar", "api", "pools"}


def test_the_wheel_packages_the_product_only():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    found = find_packages(str(ROOT), include=include)
    tops = {p.split(".")[0] for p in found}
    assert tops == PRODUCT, tops
    assert "sidecar.tiers" in found and "api.engine" in found  # subpackages too


def test_the_image_copies_the_product_only():
    text = (ROOT / "Dockerfile").read_text()
    copies = re.findall(r"^COPY\s+(.+)$", text, re.M)
    sources = {src for line in copies for src in line.split()[:-1]}
    dirs = {s for s in sources if (ROOT / s).is_dir()}
    assert dirs == PRODUCT, dirs
    assert not {"loadtest", "tests", "scripts"} & sources
