"""Engine side of the cuda_ipc transport: export regions of torch CUDA tensors.

    tensors (one per layer, K and V)      allocations            buffer regions
    k0 = kv[0][0], v0 = kv[0][1], ...  -> cudaMalloc'd bases  -> one legacy IPC handle each
                                          (deduplicated)          chunk i: region, offset

Legacy IPC shares `cudaMalloc` memory. Memory from expandable segments or other VMM
allocators (cuMemCreate) cannot be exported this way: registration fails with a message
that says what to change.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch

_VMM_HINT = (
    "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False for the engine (or allocate "
    "the KV cache with cudaMalloc), or register host memory with transport 'shm'"
)


def _cuda():
    """(runtime, driver) of cuda-python: `cuda.bindings` (cuda-bindings 12.6+ and 13.x, where
    `from cuda import cudart` is gone), else the cuda-python 12 layout."""
    try:
        from cuda.bindings import driver, runtime

        return runtime, driver
    except Exception:
        pass
    try:
        from cuda import cuda as driver
        from cuda import cudart as runtime
    except Exception as exc:
        raise RuntimeError(
            "the cuda_ipc transport needs cuda-python: pip install 'kv-sidecar[gpu]'"
        ) from exc
    return runtime, driver


def _on_device(runtime, device: int) -> None:
    """Make `device`'s primary context (torch's) current on this thread: the driver calls
    below need one, and a thread torch never used (a linker's worker) has none."""
    (err,) = runtime.cudaSetDevice(device)
    if int(err) != 0:
        raise RuntimeError(f"cudaSetDevice({device}) failed: {getattr(err, 'name', err)}")


def device_uuid(device: int) -> str:
    runtime, _ = _cuda()
    err, prop = runtime.cudaGetDeviceProperties(device)
    if int(err) != 0:
        raise RuntimeError(f"cudaGetDeviceProperties({device}) failed: {err}")
    h = bytes(prop.uuid.bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def export_allocation(ptr: int, device: int = 0) -> tuple[int, int, str]:
    """(allocation base, allocation size, handle as 128 hex) of the allocation holding `ptr`
    (device memory of `device`)."""
    runtime, driver = _cuda()
    _on_device(runtime, device)
    if (
        "expandable_segments:true"
        in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    ):
        raise ValueError(f"expandable segments cannot be shared with legacy CUDA IPC: {_VMM_HINT}")
    err, base, size = driver.cuMemGetAddressRange(driver.CUdeviceptr(ptr))
    if int(err) != 0:
        raise ValueError(f"address {ptr:#x} is not device memory of this process ({err})")
    err, handle = runtime.cudaIpcGetMemHandle(int(base))
    if int(err) != 0:
        raise ValueError(
            f"memory at {int(base):#x} cannot be shared with legacy CUDA IPC ({err}): {_VMM_HINT}"
        )
    return int(base), int(size), ctypes.string_at(handle.getPtr(), 64).hex()


def cuda_regions_and_chunks(tensors: Sequence[torch.Tensor]) -> tuple[list[dict], list[dict]]:
    """Regions (one per allocation) and chunks for pages made of slot i of each tensor."""
    if not tensors:
        raise ValueError("no tensors to export")
    devices = {t.device.index for t in tensors}
    if any(not t.is_cuda for t in tensors) or len(devices) != 1:
        raise ValueError("cuda_ipc exports CUDA tensors of one device")
    device = devices.pop()
    uuid = device_uuid(device)
    regions: list[dict] = []
    by_base: dict[int, int] = {}
    chunks: list[dict] = []
    for t in tensors:
        if t.dim() < 1 or not t[0].is_contiguous():
            raise ValueError("each tensor needs a slot dimension 0 with contiguous slots")
        base, size, handle = export_allocation(t.data_ptr(), device)
        if base not in by_base:
            by_base[base] = len(regions)
            regions.append({"handle": handle, "offset": 0, "device_uuid": uuid, "size": size})
        chunks.append(
            {
                "offset": t.data_ptr() - base,
                "stride": t.stride(0) * t.element_size(),
                "size": t[0].numel() * t.element_size(),
                "region": by_base[base],
            }
        )
    return regions, chunks


def register_cuda(client, namespace: str, tensors: Sequence[torch.Tensor], slots: int) -> str:
    """Register GPU tensors (dim 0 = slot) as one cuda_ipc buffer; return its id."""
    regions, chunks = cuda_regions_and_chunks(tensors)
    return client.register_buffer(
        namespace,
        sum(r["size"] for r in regions),
        slots,
        chunks,
        transport="cuda_ipc",
        regions=regions,
        pid=os.getpid(),
    )
