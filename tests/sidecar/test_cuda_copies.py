"""The CUDA transport's copies on a CPU machine (issue 54, "one driver call a plan"): the
sidecar's copy path (sidecar/transports/cuda_ipc.py, the submission in sidecar/_kvcopy.c)
run against the host-memory double (sidecar/transports/cuda_double.py), which counts every
driver call, those the C code makes through the driver's function pointers included.

    CUDA 13 / 12.8 driver   one cuMemcpyBatchAsync a plan, sources read in stream order
    older driver            cuMemcpyAsync a run, every one of them called from C
    either                  no cudaMemcpyAsync from Python; one stream sync a copy job

The device figures are docs/gpu.md's (`python -m loadtest.micro.cuda_copy --sweep`)."""

from __future__ import annotations

import asyncio
import ctypes
import os

import pytest

from sidecar.buffers import Buffer
from sidecar.copier import Copier
from sidecar.transports import base, cuda_ipc
from sidecar.transports.base import Chunk, CopyFailed
from sidecar.transports.cuda_double import HostCuda
from sidecar.transports.cuda_ipc import CudaIpc, IpcMapping

needs_kvcopy = pytest.mark.skipif(
    (cuda_ipc._kvcopy is None or not hasattr(cuda_ipc._kvcopy, "cuda_plan"))
    and not os.environ.get("KV_SIDECAR_CI"),
    reason="sidecar/_kvcopy.c not built (no C compiler at install)",
)
PAGE = 4096
STREAM = 1  # CU_MEMCPY_SRC_ACCESS_STREAM (cuda.h); 3 is ANY


def spread(n: int) -> list[int]:
    """`n` engine slots of 64 in an order where no two follow each other (no run merges):
    scattered block ids."""
    return [i * 37 % 64 for i in range(n)]


class Rig:
    """A CudaIpc over the double, a "device" buffer of `slots` pages of random bytes and a
    host arena of as many: what a registered cuda_ipc buffer and the host pool are."""

    def __init__(self, driver: int = 13000, slots: int = 64):
        self.cuda = HostCuda(driver)
        self.ipc = CudaIpc((self.cuda, self.cuda))
        self.slots = slots
        self.device = ctypes.create_string_buffer(os.urandom(slots * PAGE), slots * PAGE)
        self.host = ctypes.create_string_buffer(slots * PAGE)
        self.mapping = IpcMapping.local(self.ipc, 0, [ctypes.addressof(self.device)])
        self.chunks = (Chunk(0, PAGE, PAGE),)

    def pages(self, engine_slots: list[int]) -> list[tuple[int, int]]:
        """Host slot i (adjacent, as the pool places a request) for engine slot s."""
        base_ = ctypes.addressof(self.host)
        return [(base_ + i * PAGE, s) for i, s in enumerate(engine_slots)]

    def moved_right(self, engine_slots: list[int]) -> bool:
        dev, host = self.device.raw, self.host.raw
        return all(
            host[i * PAGE : (i + 1) * PAGE] == dev[s * PAGE : (s + 1) * PAGE]
            for i, s in enumerate(engine_slots)
        )

    def copy(self, engine_slots: list[int], into_engine: bool, parallel: int = 1) -> Copier:
        """One request's move through the copier (its copy threads), as a set or get does."""
        copier = Copier(threads=2 * parallel, parallel=parallel)
        buf = Buffer(
            "b-1", "kv", "cuda_ipc", self.slots * PAGE, self.slots, self.chunks, self.mapping, 0
        )

        async def main():
            assert await copier.copy(buf, self.pages(engine_slots), into_engine, lambda ok: None)

        asyncio.run(main())
        return copier


@needs_kvcopy
@pytest.mark.parametrize("driver", [13000, 12080])
def test_a_plan_goes_to_the_device_as_one_batch_call(driver):
    rig = Rig(driver)
    assert rig.ipc.calls.batch and rig.ipc.calls.abi == driver
    scattered = spread(48)
    copier = rig.copy(scattered, into_engine=False)  # a set: device -> host pool
    assert rig.moved_right(scattered)
    assert rig.cuda.calls["cuMemcpyBatchAsync"] == 1  # 48 runs, one driver call
    assert rig.cuda.batches[0][:2] == (48, STREAM)
    assert rig.cuda.calls["cuMemcpyAsync"] == rig.cuda.calls["cudaMemcpyAsync"] == 0
    assert rig.cuda.calls["cudaStreamSynchronize"] == 1
    assert (copier.times.pages, copier.times.runs) == (48, 48)


@needs_kvcopy
def test_adjacent_pages_are_one_run_and_both_directions_read_in_stream_order():
    rig = Rig()
    rig.copy(list(range(64)), into_engine=False)
    rig.device = ctypes.create_string_buffer(64 * PAGE)  # a get fills another buffer
    rig.mapping = IpcMapping.local(rig.ipc, 0, [ctypes.addressof(rig.device)])
    copier = rig.copy(list(range(64)), into_engine=True)
    assert rig.moved_right(list(range(64)))
    assert [b[:2] for b in rig.cuda.batches] == [(1, STREAM), (1, STREAM)]
    assert (copier.times.pages, copier.times.runs) == (64, 1)


@needs_kvcopy
def test_a_long_request_is_one_call_a_plan_and_one_stream_sync(monkeypatch):
    """Plans of YIELD_RUNS runs (the copy thread yields the GIL between them), each one
    driver call as it is planned, and the stream waited for once at the end."""
    monkeypatch.setattr(base, "YIELD_RUNS", 16)
    rig = Rig()
    scattered = spread(40)
    copier = rig.copy(scattered, into_engine=False)
    assert rig.moved_right(scattered)
    assert [b[0] for b in rig.cuda.batches] == [16, 16, 8]
    assert rig.cuda.calls["cuMemcpyBatchAsync"] == 3
    assert rig.cuda.calls["cudaStreamSynchronize"] == 1
    assert copier.times.runs == 40


@needs_kvcopy
def test_a_move_split_for_two_copy_threads_is_one_call_a_job(monkeypatch):
    monkeypatch.setattr(base, "SPLIT_MIN", 1)
    rig = Rig()
    scattered = spread(32)
    rig.copy(scattered, into_engine=False, parallel=2)
    assert rig.moved_right(scattered)
    assert sorted(b[0] for b in rig.cuda.batches) == [16, 16]


@needs_kvcopy
def test_without_a_batch_call_the_loop_over_runs_runs_in_c(monkeypatch):
    """A driver before CUDA 12.8: one cuMemcpyAsync a run, all of them made by the C loop
    (`_kvcopy.cuda_plan`, entered once a plan); Python calls no copy function a run."""
    rig = Rig(driver=12040)
    assert not rig.ipc.calls.batch and rig.ipc.calls.each
    entered = []
    real = cuda_ipc._kvcopy

    class Counting:
        @staticmethod
        def cuda_plan(*args):
            entered.append(len(args[0]))
            return real.cuda_plan(*args)

    monkeypatch.setattr(cuda_ipc, "_kvcopy", Counting)
    scattered = spread(30)
    rig.copy(scattered, into_engine=False)
    assert rig.moved_right(scattered)
    assert entered == [30]  # one call into C for the plan's 30 runs
    assert rig.cuda.calls["cuMemcpyAsync"] == 30  # each made from C
    assert rig.cuda.calls["cudaMemcpyAsync"] == rig.cuda.calls["cuMemcpyBatchAsync"] == 0


@needs_kvcopy
@pytest.mark.parametrize("driver,name", [(13000, "cuMemcpyBatchAsync"), (12040, "cuMemcpyAsync")])
def test_a_failed_submission_is_copy_failed_and_the_stream_is_still_waited_for(driver, name):
    rig = Rig(driver)
    rig.cuda.fail[name] = 700
    with pytest.raises(CopyFailed, match=f"{name} of 3 runs failed.*ILLEGAL_ADDRESS"):
        rig.ipc.copy(0, [[(1, 2, 3), (4, 5, 6), (7, 8, 9)]])
    assert rig.cuda.calls["cudaStreamSynchronize"] == 1  # no copy left running on the slots


def test_without_the_c_extension_the_runs_go_from_python(monkeypatch):
    monkeypatch.setattr(cuda_ipc, "_kvcopy", None)
    rig = Rig()
    assert rig.ipc.calls == cuda_ipc.CopyCalls()
    rig.copy(spread(3), into_engine=False)
    assert rig.moved_right(spread(3))
    assert rig.cuda.calls["cudaMemcpyAsync"] == 3 and rig.cuda.calls["cuMemcpyBatchAsync"] == 0


def test_the_batch_signature_asked_for_is_the_one_called():
    """cuGetProcAddress by version: CUDA 13's batch call on a CUDA 13 driver, 12.8's (with
    failIdx) on a 12.8 one; none before 12.8 (a version above the driver's is an error)."""
    for driver, abi in ((13020, 13000), (13000, 13000), (12090, 12080), (12080, 12080)):
        calls = cuda_ipc.copy_calls(HostCuda(driver))
        assert (bool(calls.batch), calls.abi) == (
            cuda_ipc._kvcopy is not None,
            abi if calls.batch else 0,
        )
    assert cuda_ipc.copy_calls(HostCuda(12040)).batch == 0
