"""The wheels a bare GPU machine needs (scripts/gpu-wheels.txt): download them and check the set.

    python scripts/gpu_wheels.py download DIR   pip download the lock list (Python 3.12,
                                                manylinux x86_64, no dependencies) into DIR
    python scripts/gpu_wheels.py check DIR      one wheel per locked name, each installable on
                                                CPython 3.12 x86_64, every requirement met by
                                                the set or the image, the project's server
                                                dependencies met, and DIR plus the working
                                                tree under the 64 MiB a device call carries

The GPU machine has no network: what its image lacks travels as wheels in the working tree
(docs/gpu.md). `make gpu-wheels` runs both.
"""

from __future__ import annotations

import email.parser
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # a bare Python: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOCK = ROOT / "scripts" / "gpu-wheels.txt"
LIMIT = 64 << 20  # what one device call carries: the working tree and the carried paths
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# The GPU image's Python packages (/work/.library/device/KINDS.md, read 2026-11-17): met there
_IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-ml-py onnx onnxruntime opencv-python-headless optax opt-einsum orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil
pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
rich safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchvision tqdm transformers
triton typer typing-extensions urllib3 uvloop werkzeug wheel wrapt xarray xxhash yarl zipp"""
IMAGE = _IMAGE.split()
ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "os_name": "posix",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "extra": "",
}


def locked() -> dict[str, str]:
    """name -> version of the lock list."""
    out = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = version.strip()
    return out


def download(dest: pathlib.Path) -> None:
    """The lock list into `dest` (emptied first: one version of each)."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".whl-", dir=dest.parent))
    try:
        plats = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
                "--implementation",
                "cp",
                *plats,
                "-d",
                str(tmp),
                "-r",
                str(LOCK),
            ],
            check=True,
        )
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def installable(filename: str) -> bool:
    """Whether a wheel installs on CPython 3.12, Linux x86_64 (glibc)."""
    _, _, _, tags = parse_wheel_filename(filename)
    for t in tags:
        py_ok = t.interpreter in ("py3", "py312", "cp312") or (
            t.abi == "abi3"
            and re.fullmatch(r"cp3(\d+)", t.interpreter)
            and int(t.interpreter[3:]) <= 12
        )
        plat_ok = t.platform == "any" or (
            t.platform.startswith("manylinux") and t.platform.endswith("x86_64")
        )
        if py_ok and t.abi in ("none", "abi3", "cp312") and plat_ok:
            return True
    return False


def requirements(wheel: pathlib.Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the GPU machine (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(ENV)]


def tree_bytes() -> int:
    """Bytes of what a device call sends besides the carried paths: tracked files and
    untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum(
        os.path.getsize(ROOT / os.fsdecode(p))
        for p in out
        if p and os.path.isfile(ROOT / os.fsdecode(p))
    )


def check(dest: pathlib.Path) -> list[str]:
    """What is wrong with the wheel set in `dest` (empty: it resolves and fits)."""
    problems: list[str] = []
    lock, have = locked(), {}
    for w in sorted(dest.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(w.name)
        if name in have:
            problems.append(f"two versions of {name}: pip --target would refuse the install")
        have[name] = (str(version), w)
        if not installable(w.name):
            problems.append(f"{w.name} does not install on CPython 3.12 x86_64")
    for name, version in lock.items():
        if have.get(name, ("",))[0] != version:
            problems.append(
                f"{name}=={version} is locked but {dest} has {have.get(name, ('none',))[0]}"
            )
    image = {canonicalize_name(n) for n in IMAGE}
    for name, (_, w) in have.items():
        for r in requirements(w):
            dep = canonicalize_name(r.name)
            if dep in have:
                if not r.specifier.contains(have[dep][0], prereleases=True):
                    problems.append(f"{name} needs {r}, the set has {dep} {have[dep][0]}")
            elif dep not in image:
                problems.append(f"{name} needs {r}: neither in the set nor in the GPU image")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for r in map(Requirement, project):
        if canonicalize_name(r.name) not in have and canonicalize_name(r.name) not in image:
            problems.append(f"the server needs {r}: neither in the set nor in the GPU image")
    total = sum(w.stat().st_size for _, w in have.values()) + tree_bytes()
    if total >= LIMIT:
        problems.append(
            f"wheels + working tree = {total / 2**20:.1f} MiB, over the {LIMIT >> 20} MiB a call carries"
        )
    return problems


def summary(dest: pathlib.Path) -> str:
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    return (
        f"{len(wheels)} wheels, {size / 2**20:.2f} MiB; with the working tree "
        f"{(size + tree_bytes()) / 2**20:.2f} MiB of {LIMIT >> 20}"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("download", "check"):
        print(__doc__)
        return 2
    dest = pathlib.Path(argv[1]).resolve()
    if argv[0] == "download":
        download(dest)
    problems = check(dest)
    for p in problems:
        print("gpu-wheels:", p, file=sys.stderr)
    print("gpu-wheels:", summary(dest), "- resolves" if not problems else "- BROKEN")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
