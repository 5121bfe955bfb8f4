"""SGLang's single-rank parallel context around every test (SGLang's test kit does the same)."""
import pytest


@pytest.fixture(autouse=True)
def single_rank():
    from tests.engines.sglang import kit  # SGLang imports here, so a missing SGLang skips/fails per module
    with kit.single_rank():
        yield
