"""The sidecar's registry of opened CUDA IPC handles (sidecar/transports/cuda_ipc.py), on a CPU
machine: CUDA's runtime replaced by a stand-in that maps handles as the driver does (a handle
opened twice in one process gives the mapping already there), so the bookkeeping can be
driven into its races. The real calls run in tests/api/test_cuda_ipc_gpu.py (marked `gpu`)."""

import ctypes
import threading
from types import SimpleNamespace

import pytest

from sidecar.transports import cuda_ipc

UUID = "GPU-12345678-1234-1234-1234-123456789abc"
HANDLE = bytes(range(64))


class Runtime:
    """What CudaIpc calls of cuda.bindings.runtime, over a table of mapped handles."""

    cudaIpcMemLazyEnablePeerAccess = 1
    cudaStreamNonBlocking = 1

    def __init__(self):
        self.mapped: dict[bytes, int] = {}  # handle -> device pointer, while mapped
        self.closed: list[int] = []
        self.next_ptr = 0x1000_0000
        self.during_sync = None  # called inside cudaDeviceSynchronize
        self.closed_one = threading.Event()

    def cudaGetDeviceCount(self):
        return 0, 1

    def cudaGetDeviceProperties(self, dev):
        return 0, SimpleNamespace(
            uuid=SimpleNamespace(bytes=bytes.fromhex(UUID[4:].replace("-", "")))
        )

    def cudaSetDevice(self, dev):
        return (0,)

    def cudaIpcMemHandle_t(self):
        buf = ctypes.create_string_buffer(64)
        return SimpleNamespace(buf=buf, getPtr=lambda: ctypes.addressof(buf))

    def cudaIpcOpenMemHandle(self, h, flags):
        handle = h.buf.raw
        if handle not in self.mapped:  # the driver: one mapping per handle and process
            self.mapped[handle], self.next_ptr = self.next_ptr, self.next_ptr + (1 << 24)
        return 0, self.mapped[handle]

    def cudaDeviceSynchronize(self):
        if self.during_sync is not None:
            self.during_sync()
        return (0,)

    def cudaIpcCloseMemHandle(self, ptr):
        self.closed.append(ptr)
        self.closed_one.set()
        self.mapped = {h: p for h, p in self.mapped.items() if p != ptr}
        return (0,)


class Driver:
    @staticmethod
    def CUdeviceptr(ptr):
        return ptr

    @staticmethod
    def cuMemGetAddressRange(ptr):
        return 0, ptr, 1 << 20


@pytest.fixture
def registry(monkeypatch):
    rt = Runtime()
    monkeypatch.setattr(cuda_ipc, "bindings", lambda: (rt, Driver()))
    return cuda_ipc.CudaIpc(), rt


def test_a_handle_is_opened_once_and_closed_by_its_last_user(registry):
    ipc, rt = registry
    a = ipc.open(7, HANDLE, UUID.lower())
    b = ipc.open(7, HANDLE, UUID.lower())
    assert a == b and len(rt.mapped) == 1
    ipc.release(7, HANDLE)
    assert rt.closed == []
    ipc.release(7, HANDLE)
    assert rt.closed == [a[0]] and rt.mapped == {}


def test_an_open_during_the_last_close_gets_a_live_mapping(registry):
    """The engine registers the handle again while the sidecar closes it (device sync, then
    close): the new registration must not be handed the mapping being closed."""
    ipc, rt = registry
    ptr = ipc.open(7, HANDLE, UUID.lower())[0]
    got: dict = {}
    other = threading.Thread(
        target=lambda: got.setdefault("ptr", ipc.open(7, HANDLE, UUID.lower())[0])
    )

    def open_meanwhile():
        other.start()
        other.join(0.3)  # bounded: it must not finish before the close (it waits for the registry)

    rt.during_sync = open_meanwhile
    ipc.release(7, HANDLE)
    rt.during_sync = None
    other.join(10)
    assert rt.closed == [ptr]
    assert got["ptr"] in rt.mapped.values()  # alive: opened after the close


def test_a_mapping_closes_its_handles_off_the_calling_thread(registry):
    ipc, rt = registry
    m = cuda_ipc.IpcMapping(ipc, 7, [(HANDLE, 0, UUID.lower(), 4096)])
    held = threading.Event()
    rt.during_sync = lambda: held.wait(5)
    m.close()  # returns while the device sync is held
    assert rt.closed == []
    held.set()
    assert rt.closed_one.wait(10)
    assert len(rt.closed) == 1


def test_copy_errors_fail_the_pages_not_the_request(registry):
    """A failed device copy is CopyFailed (its pages answer false), not a caller's 4xx: here
    on the path without the C extension (this driver double has no entry points), one
    cudaMemcpyAsync a run from Python. The C path's: tests/sidecar/test_cuda_copies.py."""
    ipc, rt = registry
    assert ipc.calls == cuda_ipc.CopyCalls()
    rt.cudaMemcpyKind = SimpleNamespace(cudaMemcpyDefault=4)
    rt.cudaStreamCreateWithFlags = lambda flags: (0, "stream")
    rt.cudaStreamSynchronize = lambda stream: (0,)
    rt.cudaMemcpyAsync = lambda *a: (700,)  # cudaErrorIllegalAddress
    with pytest.raises(cuda_ipc.CopyFailed, match="cudaMemcpyAsync"):
        ipc.copy(0, [[(1, 2, 3)]])
