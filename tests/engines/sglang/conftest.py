"""SGLang's single-rank parallel context (SGLang's test kit does the same) and a fixed host
memory budget around every test."""

import pytest


@pytest.fixture(autouse=True)
def single_rank():
    from loadtest.kit.sglang import pools as kit  # SGLang imports here: skips per module

    with kit.single_rank(), kit.host_budget():
        yield


@pytest.fixture
def unpinned(monkeypatch):
    """Host pools built by SGLang's assemblers, without cudaHostRegister (GPU-only; see
    assembled.py)."""
    from tests.engines.sglang import assembled

    monkeypatch.setattr(assembled.host_common, "_cuda_host_register", assembled._no_pinning)
