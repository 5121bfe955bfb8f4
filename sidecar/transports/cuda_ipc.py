"""CUDA IPC engine buffers. The only module of the sidecar that touches CUDA.

An engine exports its GPU memory as legacy IPC handles (one per allocation: per-layer K/V
tensors are many allocations) and registers them as one buffer of one or more regions:

    {"transport": "cuda_ipc", "pid": 4242, "size": ..., "slots": ...,
     "handle": "<128 hex>", "offset": 0, "device_uuid": "GPU-..."}           one region, or
     "regions": [{"handle", "offset", "device_uuid", "size"}, ...]           several;
     "chunks": [{"offset", "stride", "size", "region"}, ...]

The sidecar opens each handle once per engine process (`cudaIpcOpenMemHandle`), keeps it
while any buffer uses it, and closes it exactly once after syncing the device. Copies run
on non-default streams (one per copy thread), on the copy engines (no kernel), and sync
once a job before answering. A plan's runs reach the driver in one call from C
(sidecar/_kvcopy.c `cuda_plan`, the GIL released), unified addressing telling host arena
from device:

    cuMemcpyBatchAsync (CUDA 12.8+)   one call a plan; every source read in stream order
    cuMemcpyAsync, a C loop           drivers without it: one call a run, none from Python
    cudaMemcpyAsync from Python       only without the C extension (no compiler at install)

Stream order (CU_MEMCPY_SRC_ACCESS_ORDER_STREAM), never "any": "any" lets the DMA read a
source before earlier work on the stream has written it (vllm-project/vllm#39306). The
entry points come from the driver (`cuGetProcAddress`), asked for the version whose
signature `_kvcopy.c` calls: CUDA 13's batch call lost 12.8's `failIdx` argument. Without
a CUDA device nothing here calls CUDA: registration answers `transport_unavailable`.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sidecar.errors import BadRequest, GeometryMismatch, TransportUnavailable
from sidecar.transports.base import CopyFailed, _nonneg_int

try:  # C (sidecar/_kvcopy.c): a plan's runs handed to the driver without Python per run
    from sidecar import _kvcopy
except ImportError:  # pragma: no cover - built wherever the package is installed
    _kvcopy = None  # type: ignore[assignment]

log = logging.getLogger("kv_sidecar.cuda")
ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources read in stream order
BATCH_ABIS = (13000, 12080)  # cuMemcpyBatchAsync's signatures: CUDA 13's, then 12.8's
_HANDLE = re.compile(r"[0-9a-fA-F]{128}")
_UUID = re.compile(
    r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
)


def parse_handle(body: dict[str, Any]) -> tuple[bytes, int, str]:
    """(64-byte handle, offset from the allocation base, device UUID), or BadRequest."""
    handle = body.get("handle")
    if not isinstance(handle, str) or not _HANDLE.fullmatch(handle):
        raise BadRequest("'handle' must be 128 hex characters (a 64-byte cudaIpcMemHandle_t)")
    offset = _nonneg_int(body.get("offset", 0), "'offset'")
    uuid = body.get("device_uuid")
    if not isinstance(uuid, str) or not _UUID.fullmatch(uuid):
        raise BadRequest("'device_uuid' must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")
    return bytes.fromhex(handle), offset, uuid.lower()


def parse_regions(body: dict[str, Any], size: int) -> list[tuple[bytes, int, str, int]]:
    """Every region as (handle, offset, uuid, size): `regions`, or the single-handle form."""
    raw = body.get("regions")
    if raw is None:
        return [(*parse_handle(body), size)]
    if not isinstance(raw, list) or not 1 <= len(raw) <= 4096:
        raise BadRequest("'regions' must be a list of 1-4096 {handle, offset, device_uuid, size}")
    out = []
    for i, r in enumerate(raw):
        if not isinstance(r, dict):
            raise BadRequest(f"regions[{i}] must be an object")
        out.append((*parse_handle(r), _nonneg_int(r.get("size"), f"regions[{i}].size", 1)))
    return out


def bindings() -> tuple[Any, Any]:
    """(runtime, driver) of cuda-python: `cuda.bindings` (cuda-bindings 12.6+ and 13.x,
    where the old `from cuda import cudart` is gone), else the cuda-python 12 layout;
    (None, None) without either. Same calls and error tuples in both."""
    try:
        from cuda.bindings import driver, runtime

        return runtime, driver
    except Exception:
        pass
    try:
        from cuda import cuda as driver
        from cuda import cudart as runtime

        return runtime, driver
    except Exception:
        return None, None


def _runtime():
    return bindings()[0]


def cuda_available() -> bool:
    """True when a CUDA driver and at least one device answer. Never raises."""
    rt = _runtime()
    if rt is None:
        return False
    try:
        err, count = rt.cudaGetDeviceCount()
        return int(err) == 0 and count > 0
    except Exception:
        return False


def register_host_memory(address: int, size: int) -> bool:
    """cudaHostRegister the host arena when CUDA is present; False (and no CUDA call) otherwise."""
    if not cuda_available():
        return False
    rt = _runtime()
    try:
        (err,) = rt.cudaHostRegister(address, size, rt.cudaHostRegisterPortable)
    except Exception as exc:
        log.warning("cudaHostRegister of the host pool raised (copies stay pageable): %s", exc)
        return False
    if int(err) != 0:
        log.warning(
            "cudaHostRegister of the host pool (%d bytes) failed: %s; device copies "
            "stay correct but go through pageable memory",
            size,
            getattr(err, "name", err),
        )
    return int(err) == 0


@dataclass(frozen=True)
class CopyCalls:
    """The driver entry points a plan goes by: `batch` (cuMemcpyBatchAsync, of signature
    `abi`) and `each` (cuMemcpyAsync); all 0: cudaMemcpyAsync a run from Python."""

    batch: int = 0
    abi: int = 0
    each: int = 0

    @property
    def name(self) -> str:
        if self.batch:
            return "cuMemcpyBatchAsync"
        return "cuMemcpyAsync" if self.each else "cudaMemcpyAsync"

    def describe(self) -> str:
        if self.batch:
            major, minor = divmod(self.abi // 10, 100)
            return f"one cuMemcpyBatchAsync a plan (the CUDA {major}.{minor} signature)"
        if self.each:
            return "cuMemcpyAsync a run, looped in C (the driver has no cuMemcpyBatchAsync)"
        return "cudaMemcpyAsync a run from Python (no C submission: _kvcopy or the driver)"


def copy_calls(drv) -> CopyCalls:
    """The driver's copy entry points (`cuGetProcAddress`): cuMemcpyBatchAsync where the
    driver has it, asked for by the version whose signature is called (a driver older than
    the version asked answers an error, never an older signature); cuMemcpyAsync for the
    loop. CopyCalls() without the C extension or when the driver cannot be asked."""
    if _kvcopy is None or not hasattr(_kvcopy, "cuda_plan"):
        return CopyCalls()
    try:
        version = int(_check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
        each = _proc(drv, b"cuMemcpyAsync", 4000)
        for abi in BATCH_ABIS:
            batch = _proc(drv, b"cuMemcpyBatchAsync", abi) if version >= abi else 0
            if batch:
                return CopyCalls(batch, abi, each)
    except Exception as exc:
        log.warning("the CUDA driver's copy entry points cannot be read (%s)", exc)
        return CopyCalls()
    return CopyCalls(0, 0, each)


def _proc(drv, symbol: bytes, version: int) -> int:
    """The address of a driver function of the signature of CUDA `version`; 0 if none."""
    err, pfn, *_ = drv.cuGetProcAddress(symbol, version, 0)
    return int(pfn or 0) if int(err) == 0 else 0


def _driver_error(drv, err: int) -> str:
    try:
        return str(drv.CUresult(err).name)
    except Exception:
        return f"CUresult {err}"


def _check(result, what: str, error: type[Exception] = GeometryMismatch):
    """The value(s) of a cuda-python call's (err, value...) tuple; `error` when err != 0."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise error(f"{what} failed: {getattr(err, 'name', err)}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class CudaIpc:
    """The process-wide registry of opened IPC handles (created once, only with CUDA)."""

    def __init__(self, cuda: tuple[Any, Any] | None = None) -> None:
        """`cuda`: (runtime, driver), cuda-python's by default (`bindings`); a double on
        a machine without a GPU (sidecar/transports/cuda_double.py)."""
        self.rt, self.drv = cuda or bindings()
        self.calls = copy_calls(self.drv)
        self._lock = threading.Lock()
        self._open: dict[tuple[int, bytes], list] = {}  # (pid, handle) -> [ptr, refs, device]
        self._streams = threading.local()
        self._closing: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._close_loop, name="kv-cuda-close", daemon=True).start()
        self.devices = self._devices()
        if self.calls.batch or self.calls.each:
            log.info("CUDA copies: %s", self.calls.describe())
        else:
            log.warning("CUDA copies: %s", self.calls.describe())

    @classmethod
    def create(cls) -> CudaIpc | None:
        """The registry, or None without CUDA (or when the devices cannot be listed: the
        sidecar still starts, and cuda_ipc registrations answer `transport_unavailable`)."""
        if not cuda_available():
            return None
        try:
            return cls()
        except Exception as exc:
            log.warning(
                "CUDA is present but its devices cannot be listed (%s): cuda_ipc is off", exc
            )
            return None

    def _devices(self) -> dict[str, int]:
        out = {}
        for dev in range(_check(self.rt.cudaGetDeviceCount(), "cudaGetDeviceCount")):
            raw = bytes(
                _check(self.rt.cudaGetDeviceProperties(dev), "cudaGetDeviceProperties").uuid.bytes
            )
            h = raw.hex()
            out[f"gpu-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"] = dev
        return out

    def open(self, pid: int, handle: bytes, uuid: str) -> tuple[int, int, int]:
        """(device pointer of the allocation base, allocation size, device); opened once."""
        dev = self.devices.get(uuid)
        if dev is None:
            raise BadRequest(
                f"device {uuid} is not visible to the sidecar; run it with the "
                f"same GPUs visible as the engine"
            )
        with self._lock:
            entry = self._open.get((pid, handle))
            if entry is None:
                _check(self.rt.cudaSetDevice(dev), "cudaSetDevice")
                h = self.rt.cudaIpcMemHandle_t()
                ctypes.memmove(h.getPtr(), handle, 64)
                ptr = int(
                    _check(
                        self.rt.cudaIpcOpenMemHandle(h, self.rt.cudaIpcMemLazyEnablePeerAccess),
                        "cudaIpcOpenMemHandle (same GPU? --pid=host?)",
                    )
                )
                try:
                    _, size = _check(
                        self.drv.cuMemGetAddressRange(self.drv.CUdeviceptr(ptr)),
                        "cuMemGetAddressRange",
                    )
                except Exception:
                    self.rt.cudaIpcCloseMemHandle(ptr)
                    raise
                entry = self._open[(pid, handle)] = [ptr, 0, dev, int(size)]
            entry[1] += 1
            return entry[0], entry[3], entry[2]

    def release(self, pid: int, handle: bytes) -> None:
        """Drop one use; the last closes the handle after the device is synced. The close
        holds the lock: an open of the same handle meanwhile (the engine registering it
        again) would get the mapping about to be closed."""
        with self._lock:
            entry = self._open.get((pid, handle))
            assert entry is not None and entry[1] > 0, "release of a handle that is not open"
            entry[1] -= 1
            if entry[1]:
                return
            del self._open[(pid, handle)]
            ptr, _, dev, _ = entry
            try:  # a mapping's close never raises (the handle is forgotten either way)
                _check(self.rt.cudaSetDevice(dev), "cudaSetDevice")
                _check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
                _check(self.rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")
            except Exception as exc:
                log.warning("closing a CUDA IPC handle of pid %d failed: %s", pid, exc)

    def release_later(self, pid: int, handles: list[bytes]) -> None:
        """Release on the registry's one closing thread, in order: a caller (the event loop
        too) never waits for a device sync or the lock, and a flood of closes costs no threads."""
        self._closing.put((pid, handles))

    def _close_loop(self) -> None:
        while True:
            pid, handles = self._closing.get()
            for handle in reversed(handles):
                try:
                    self.release(pid, handle)
                except Exception:  # never ends the thread: later closes still run
                    log.exception("releasing a CUDA IPC handle of pid %d", pid)

    def stream(self, dev: int):
        streams = getattr(self._streams, "by_dev", None)
        if streams is None:
            streams = self._streams.by_dev = {}
        if dev not in streams:
            _check(self.rt.cudaSetDevice(dev), "cudaSetDevice", CopyFailed)
            streams[dev] = _check(
                self.rt.cudaStreamCreateWithFlags(self.rt.cudaStreamNonBlocking),
                "cudaStreamCreateWithFlags",
                CopyFailed,
            )
        return streams[dev]

    def copy(self, dev: int, plans: Iterable[list]) -> int:
        """Run plans of (dst, src, n) copies between the host arena and device memory on
        this copy thread's stream, each submitted as it comes (`submit`), and wait for them
        once, after a failed one too (no copy runs on once its slots are given back). A
        failed copy is `CopyFailed` (its pages answer false), never a caller error."""
        _check(self.rt.cudaSetDevice(dev), "cudaSetDevice", CopyFailed)
        moved = 0
        try:
            for plan in plans:
                moved += self.submit(dev, plan)
        finally:
            self.wait(dev)
        return moved

    def submit(self, dev: int, plan: list) -> int:
        """Queue a plan's runs on this thread's stream (its device current); the bytes.
        One driver call from C (`CopyCalls`); a run at a time from Python only without the
        C extension."""
        stream, calls = self.stream(dev), self.calls
        if calls.batch or calls.each:
            moved, err, run = _kvcopy.cuda_plan(
                plan if type(plan) is list else list(plan),
                int(stream),
                calls.batch,
                calls.abi,
                calls.each,
                ORDER_STREAM,
            )
            if err:
                where = f" at run {run}" if run >= 0 else ""
                why = _driver_error(self.drv, err)
                raise CopyFailed(f"{calls.name} of {len(plan)} runs failed{where}: {why}")
            return moved
        kind, moved = self.rt.cudaMemcpyKind.cudaMemcpyDefault, 0
        for dst, src, n in plan:
            _check(
                self.rt.cudaMemcpyAsync(dst, src, n, kind, stream), "cudaMemcpyAsync", CopyFailed
            )
            moved += n
        return moved

    def wait(self, dev: int) -> None:
        """Wait for this thread's stream on `dev` (its device current)."""
        _check(self.rt.cudaStreamSynchronize(self.stream(dev)), "cudaStreamSynchronize", CopyFailed)


class IpcMapping:
    """An engine buffer's regions opened in the sidecar; `addresses` are device pointers."""

    def __init__(self, cuda: CudaIpc, pid: int, regions: list[tuple[bytes, int, str, int]]):
        self.cuda, self.pid, self.addresses, self._opened = cuda, pid, [], []
        try:
            devices = set()
            for handle, offset, uuid, size in regions:
                base, alloc, dev = cuda.open(pid, handle, uuid)
                self._opened.append(handle)
                if offset + size > alloc:
                    raise GeometryMismatch(
                        f"region of {size} bytes at offset {offset} runs past "
                        f"its allocation of {alloc} bytes"
                    )
                self.addresses.append(base + offset)
                devices.add(dev)
            if len(devices) != 1:
                raise BadRequest("all regions of a buffer must be on one GPU")
            self.device = devices.pop()
        except Exception:
            self.close()
            raise

    @classmethod
    def local(cls, cuda: CudaIpc, device: int, addresses: list[int]) -> IpcMapping:
        """Device memory this process holds itself (the CUDA bench's sweep, the CPU tests):
        the same copy path, with no handle to open or close."""
        m = cls.__new__(cls)
        m.cuda, m.pid, m.addresses, m._opened, m.device = cuda, 0, list(addresses), [], device
        return m

    def run_plan(self, plan, into_engine: bool = False) -> int:
        """The driver works out the direction from the addresses (UVA)."""
        return self.cuda.copy(self.device, (plan,))

    def run_plans(self, plans: Iterable[list], into_engine: bool = False) -> int:
        """A job's plans, each submitted as it is planned; the stream synced once."""
        return self.cuda.copy(self.device, plans)

    def close(self) -> None:
        """Release the handles on a thread of their own: the last use of a handle syncs the
        device before closing it, and a buffer's close may run on the event loop."""
        handles, self._opened = self._opened, []
        if handles:
            self.cuda.release_later(self.pid, handles)


def open_buffer(body: dict[str, Any], cuda: CudaIpc | None, pid: int | None, size: int):
    """Validate the regions, then open them (needs CUDA on this node)."""
    regions = parse_regions(body, size)
    if cuda is None:
        raise TransportUnavailable(
            f"cuda_ipc needs a CUDA device on the sidecar's node and none is visible "
            f"(device {regions[0][2]}); register the buffer with transport 'shm' instead"
        )
    if pid is None:
        raise BadRequest("a cuda_ipc buffer needs the engine's 'pid' (handles are per process)")
    return IpcMapping(cuda, pid, regions)
