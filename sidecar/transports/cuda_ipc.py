"""CUDA IPC engine buffers. The only module of the project that touches CUDA.

This module validates registrations on any machine; opening handles needs a CUDA device
with the engine's GPU visible. Without one, a registration answers `transport_unavailable`
and engines use the shm transport instead.
"""
from __future__ import annotations

import re
from typing import Any

from sidecar.errors import BadRequest, TransportUnavailable

_HANDLE = re.compile(r"[0-9a-fA-F]{128}")
_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def parse_handle(body: dict[str, Any]) -> tuple[bytes, int, str]:
    """(64-byte handle, offset from the allocation base, device UUID), or BadRequest."""
    handle = body.get("handle")
    if not isinstance(handle, str) or not _HANDLE.fullmatch(handle):
        raise BadRequest("'handle' must be 128 hex characters (a 64-byte cudaIpcMemHandle_t)")
    offset = body.get("offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise BadRequest("'offset' must be an integer >= 0")
    uuid = body.get("device_uuid")
    if not isinstance(uuid, str) or not _UUID.fullmatch(uuid):
        raise BadRequest("'device_uuid' must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")
    return bytes.fromhex(handle), offset, uuid


def cuda_available() -> bool:
    """True when a CUDA driver and at least one device answer. Never raises."""
    try:
        from cuda.bindings import runtime  # type: ignore
    except Exception:
        return False
    try:
        err, count = runtime.cudaGetDeviceCount()
        return int(err) == 0 and count > 0
    except Exception:
        return False


def open_buffer(body: dict[str, Any]):
    """Open an engine's IPC handle. Needs CUDA on this node."""
    handle, offset, uuid = parse_handle(body)
    if not cuda_available():
        raise TransportUnavailable(
            f"cuda_ipc needs a CUDA device on the sidecar's node and none is visible "
            f"(device {uuid}); register the buffer with transport 'shm' instead")
    raise TransportUnavailable("cuda_ipc copies are not enabled in this build; use 'shm'")


def register_host_memory(address: int, size: int) -> bool:
    """cudaHostRegister the host arena when CUDA is present; False (and no CUDA call) otherwise."""
    if not cuda_available():
        return False
    try:
        from cuda.bindings import runtime  # type: ignore
        err, = runtime.cudaHostRegister(address, size, runtime.cudaHostRegisterPortable)
        return int(err) == 0
    except Exception:
        return False
