"""Engine-side shared memory: torch tensors in a memfd the sidecar can map, and chunk
descriptors for the common page layouts.

    SharedBuffer (memfd, MAP_SHARED)            chunks of slot i
    +---- tensor A (slots, a) ----+---- tensor B (slots, b) ----+
    | A[0] | A[1] | ... | A[n-1]  | B[0] | B[1] | ... | B[n-1]  |  A[i] then B[i] = page i
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import mmap
import os
from collections.abc import Sequence

import torch


class SharedBuffer:
    """`nbytes` of memfd-backed memory owned by this process, viewable as torch tensors."""

    def __init__(self, nbytes: int, name: str = "kv-engine", sealable: bool = True):
        if nbytes <= 0:
            raise ValueError("nbytes must be > 0")
        self.size = nbytes
        # inheritable (a worker may pass it on); sealable, so the sidecar can seal it against
        # shrinking and map it (unsealable, it copies with pread/pwrite instead)
        self.fd = os.memfd_create(name, os.MFD_ALLOW_SEALING if sealable else 0)
        os.ftruncate(self.fd, nbytes)
        mm = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED)
        self._mm: mmap.mmap | None = mm
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(mm)
        self.address = ctypes.addressof(self._anchor)
        self._bytes: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8)

    @property
    def bytes(self) -> torch.Tensor:
        """The whole buffer as uint8 (no copy); only until `close`."""
        if self._bytes is None:
            raise ValueError("the buffer is closed")
        return self._bytes

    def tensor(
        self, shape: Sequence[int], dtype: torch.dtype = torch.uint8, offset: int = 0
    ) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over the buffer's bytes at `offset` (no copy)."""
        count = 1
        for d in shape:
            count *= d
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"tensor of {nbytes} bytes at {offset} does not fit in {self.size}")
        return self.bytes[offset : offset + nbytes].view(dtype).view(*shape)

    def view(self, offset: int, length: int) -> memoryview:
        """Writable bytes [offset, offset + length) of the buffer (no copy)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range [{offset}, {offset + length}) is outside the buffer")
        if self._mm is None:
            raise ValueError("the buffer is closed")
        return memoryview(self._mm)[offset : offset + length]

    def tensor_bytes(self, t: torch.Tensor) -> builtins.bytes:  # `bytes` is ours, here
        """A copy of the bytes of a contiguous tensor that lives in this buffer."""
        return self.view(t.data_ptr() - self.address, t.numel() * t.element_size()).tobytes()

    def where(self) -> dict:
        """The registration fields that let the sidecar map this memory (the client lends
        the fd over the engine socket)."""
        return {"fd": self.fd}

    def register(self, client, namespace: str, slots: int, chunks: list[dict]) -> str:
        """Register with `client` (a unix:// client); keep it alive while in use."""
        return client.register_buffer(namespace, self.size, slots, chunks, **self.where())

    def close(self) -> None:
        if self._mm is not None:
            self._bytes = None
            self._anchor = None
            with contextlib.suppress(
                BufferError
            ):  # a tensor view is alive; the mapping goes with it
                self._mm.close()
            self._mm = None
            os.close(self.fd)


def tensor_chunks(buffer: SharedBuffer, tensors: Sequence[torch.Tensor]) -> list[dict]:
    """Chunks for pages made of slot i of each tensor (dim 0 = slot), in order.

    Covers page_first (one tensor), K/V split (two) and layer_first (2 x layers).
    Each `t[i]` must be contiguous and lie inside `buffer`.
    """
    chunks = []
    for t in tensors:
        if t.dim() < 1 or not t[0].is_contiguous():
            raise ValueError("each tensor needs a slot dimension 0 with contiguous slots")
        offset = t.data_ptr() - buffer.address
        if not 0 <= offset < buffer.size:
            raise ValueError("tensor does not live in this shared buffer")
        chunks.append(
            {
                "offset": offset,
                "stride": t.stride(0) * t.element_size(),
                "size": t[0].numel() * t.element_size(),
            }
        )
    return chunks


def page_first_chunks(page_bytes: int, offset: int = 0) -> list[dict]:
    """One run per page: slot i is bytes [offset + i*page_bytes, +page_bytes)."""
    return [{"offset": offset, "stride": page_bytes, "size": page_bytes}]
