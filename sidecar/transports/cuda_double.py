"""A CUDA runtime and driver over host memory, for machines without a GPU.

The CPU tests of the CUDA transport and `python -m loadtest.micro.cuda_copy --sweep --dry-run`
run the sidecar's own copy path against it: `CudaIpc((double, double))` (cuda_ipc.py), the
plans of sidecar/transports/base.py and the submission in C (sidecar/_kvcopy.c
`cuda_plan`), which calls this double's driver entry points as it would call the driver's:
through the function pointers `cuGetProcAddress` gives (ctypes callbacks here). "Device"
memory is host memory, a copy is a memmove done when it is submitted, and every call is
counted by name in `calls`, those made from C included:

    HostCuda(driver=13000)   cuMemcpyBatchAsync with CUDA 13's signature
    HostCuda(driver=12080)   the same with 12.8's (its failIdx argument)
    HostCuda(driver=12040)   no batch call: the C loop of cuMemcpyAsync

Nothing here imports CUDA; it is no part of the sidecar's serving path.
"""

from __future__ import annotations

import ctypes
import enum
from collections import Counter
from types import SimpleNamespace
from typing import Any

UUID = "GPU-12345678-1234-1234-1234-123456789abc"


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_ILLEGAL_ADDRESS = 700


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (cuda.h): 24 bytes."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


_PTRS = ctypes.POINTER(ctypes.c_uint64)
_SIZES = ctypes.POINTER(ctypes.c_size_t)
_ATTRS = ctypes.POINTER(MemcpyAttributes)
_EACH = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
)
# cuMemcpyBatchAsync: dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, then 12.8's
# failIdx, then the stream
_BATCH_ARGS = (_PTRS, _PTRS, _SIZES, ctypes.c_size_t, _ATTRS, _SIZES, ctypes.c_size_t)
_BATCH_13000 = ctypes.CFUNCTYPE(ctypes.c_int, *_BATCH_ARGS, ctypes.c_void_p)
_BATCH_12080 = ctypes.CFUNCTYPE(ctypes.c_int, *_BATCH_ARGS, _SIZES, ctypes.c_void_p)


class Stream:
    """A cudaStream_t: `int()` gives its handle."""

    def __init__(self, handle: int):
        self.handle = handle

    def __int__(self) -> int:
        return self.handle


class HostCuda:
    """Both halves of cuda-python (pass `(double, double)` as `CudaIpc`'s bindings)."""

    cudaStreamNonBlocking = 1
    cudaIpcMemLazyEnablePeerAccess = 1
    cudaHostRegisterPortable = 1
    cudaMemcpyKind = SimpleNamespace(cudaMemcpyDefault=4)
    CUresult = CUresult

    def __init__(self, driver: int = 13000):
        self.driver = driver
        self.calls: Counter[str] = Counter()  # every call by name, those made from C too
        self.batches: list[tuple[int, int, int]] = []  # (runs, source order, stream) a batch
        self.fail: dict[str, int] = {}  # name -> the CUresult its calls answer
        self._memory: dict[int, Any] = {}  # address -> the buffer behind it
        self._streams = 0
        self._fns = {  # kept alive: C calls them by address
            "cuMemcpyAsync": _EACH(self._each),
            13000: _BATCH_13000(self._batch_13000),
            12080: _BATCH_12080(self._batch_12080),
        }

    # -- the runtime --------------------------------------------------------------------
    def cudaGetDeviceCount(self):
        return 0, 1

    def cudaGetDeviceProperties(self, dev):
        uuid = bytes.fromhex(UUID[4:].replace("-", ""))
        return 0, SimpleNamespace(uuid=SimpleNamespace(bytes=uuid), name=b"host memory")

    def cudaSetDevice(self, dev):
        return (0,)

    def cudaDeviceSynchronize(self):
        return (0,)

    def cudaStreamCreateWithFlags(self, flags):
        self._streams += 1
        return 0, Stream(0x5000 + self._streams)

    def cudaStreamSynchronize(self, stream):
        self.calls["cudaStreamSynchronize"] += 1
        return (0,)

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        """The runtime's copy, called from Python (the raw copy a bench compares with)."""
        self.calls["cudaMemcpyAsync"] += 1
        err = self.fail.get("cudaMemcpyAsync", 0)
        if not err:
            ctypes.memmove(dst, src, n)
        return (err,)

    def cudaMalloc(self, n: int):
        buf = ctypes.create_string_buffer(n)
        self._memory[ctypes.addressof(buf)] = buf
        return 0, ctypes.addressof(buf)

    cudaMallocHost = cudaMalloc

    def cudaFree(self, ptr: int):
        self._memory.pop(int(ptr), None)
        return (0,)

    cudaFreeHost = cudaFree

    # -- the driver ---------------------------------------------------------------------
    def cuDriverGetVersion(self):
        return 0, self.driver

    def cuGetProcAddress(self, symbol: bytes, version: int, flags: int):
        """As the driver: a version above its own is an error; a function newer than the
        version asked for, or unknown, is a null pointer."""
        if version > self.driver:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None, None
        fn = None
        if symbol == b"cuMemcpyAsync":
            fn = self._fns["cuMemcpyAsync"]
        elif symbol == b"cuMemcpyBatchAsync" and version >= 12080:
            fn = self._fns[13000 if version >= 13000 else 12080]
        pfn = ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else 0
        return CUresult.CUDA_SUCCESS, pfn, 0 if pfn else 1

    @staticmethod
    def CUdeviceptr(ptr):
        return ptr

    @staticmethod
    def cuMemGetAddressRange(ptr):
        return 0, ptr, 1 << 20

    # -- what C calls -------------------------------------------------------------------
    def _each(self, dst: int, src: int, n: int, stream) -> int:
        self.calls["cuMemcpyAsync"] += 1
        err = self.fail.get("cuMemcpyAsync", 0)
        if not err:
            ctypes.memmove(dst, src, n)
        return err

    def _batch(self, dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream) -> int:
        """The checks cuMemcpyBatchAsync makes (not the legacy stream; attributes from copy
        0; a valid source access order), then the copies."""
        self.calls["cuMemcpyBatchAsync"] += 1
        order = attrs[0].srcAccessOrder if num_attrs else 0
        self.batches.append((count, order, stream or 0))
        if not stream or num_attrs < 1 or idxs[0] != 0 or order not in (1, 2, 3):
            return CUresult.CUDA_ERROR_INVALID_VALUE
        err = self.fail.get("cuMemcpyBatchAsync", 0)
        if not err:
            for i in range(count):
                ctypes.memmove(dsts[i], srcs[i], sizes[i])
        return err

    def _batch_13000(self, dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream) -> int:
        return self._batch(dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream)

    def _batch_12080(self, dsts, srcs, sizes, count, attrs, idxs, num_attrs, fail_idx, stream):
        err = self._batch(dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream)
        fail_idx[0] = 0 if err else ctypes.c_size_t(-1).value
        return err
