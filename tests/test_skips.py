"""Skips that must not hide breakage (issue 18): a broken import of our own CUDA module is
an error, never "no CUDA device"; a missing ../shared fails where CI says it must be there."""

import sys

import pytest

from tests import conftest
from tests.api.cli import test_replay


def test_a_broken_cuda_ipc_import_is_an_error_not_a_skip(monkeypatch):
    monkeypatch.setitem(sys.modules, "sidecar.transports.cuda_ipc", None)  # import fails
    with pytest.raises(ImportError):
        conftest._has_cuda()


def test_no_cuda_device_is_a_clean_false():
    from sidecar.transports.cuda_ipc import cuda_available

    assert conftest._has_cuda() is cuda_available()


def test_missing_shared_trace_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setattr(test_replay, "TRACE", str(tmp_path / "absent.jsonl"))
    monkeypatch.setenv("KV_SIDECAR_CI", "1")
    with pytest.raises(pytest.fail.Exception, match="KV_SIDECAR_CI=1"):
        test_replay.trace_path()
    monkeypatch.delenv("KV_SIDECAR_CI")
    with pytest.raises(pytest.skip.Exception):
        test_replay.trace_path()
