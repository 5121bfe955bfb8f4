"""The SGLang linker's device path: device pools registered with the sidecar by CUDA IPC,
pages copied by the sidecar on its own streams once the linker's events have completed.

    engine (linker)                                   sidecar
    device pool  K0 K1 .. V0 V1 .. (one tensor each)  registered once per pool: one cuda_ipc
      |  forward writes pages, records an event       buffer, a chunk per tensor, slot = page
      v
    offload thread: event.synchronize() (the gate)  -> batch/set {keys, slots = page numbers}
                                                       copies device -> host pool on its
                                                       streams, synced before it answers
    load thread:                                    -> batch/get: host pool -> device pages on
    then the layer counter completes                   its streams, synced before it answers

No staging copy and no torch kernel on the engine's side: the sidecar moves the bytes. The
sidecar page is the same as the staging path's (each tensor's bytes of a page in the pool's
order), so a linker on a GPU and one on a CPU share pages. The gate is kept on the engine's
side (the sidecar's copies start after the offload thread saw the events complete): the
HTTP contract carries no CUDA events. Nothing here imports SGLang: the GPU tests drive it
with plain torch tensors laid out as SGLang's pools (tests/engines/adapters/test_linker_cuda_gpu.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from api.engine.client import SidecarClient, SidecarError

log = logging.getLogger("kv_sidecar.sglang_linker")
MIN_PAGE = 512  # the sidecar's smallest page: a smaller pool page needs the staging path


def page_views(buffers: Sequence[torch.Tensor], span: int) -> list[torch.Tensor]:
    """Each buffer (rows of a token, or of a page) as uint8 (pages, its bytes of a page):
    `span` rows make a page; rows past the last whole page are left out."""
    rows = [b.view(torch.uint8).view(b.shape[0], -1) for b in buffers]
    return [
        r[: r.shape[0] // span * span].reshape(r.shape[0] // span, span * r.shape[1]) for r in rows
    ]


def page_numbers(rows: Iterable[int], span: int) -> list[int]:
    """The pool's page numbers (the cuda_ipc buffer's slots) of SGLang's locations."""
    return [int(r) // span for r in rows]


def can_go_direct(views: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> str | None:
    """None when a pool can be registered by CUDA IPC, else why not (the staging path then).
    `views` are `page_views(buffers, ...)`: each must be the buffer's own memory, never a
    copy a reshape made (the sidecar would write into a temporary)."""
    if (
        not views
        or len(views) != len(buffers)
        or any(
            v.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            for v, b in zip(views, buffers, strict=True)
        )
    ):
        return "a buffer's pages are not a view of it"
    if sum(v.shape[1] for v in views) < MIN_PAGE:
        return f"a page of fewer than {MIN_PAGE} bytes"
    if any(not v[0].is_contiguous() for v in views):
        return "a page of a buffer is not contiguous"
    if any(not v.is_cuda for v in views):
        return "not on a CUDA device"
    if len({v.device.index for v in views}) != 1:
        return "buffers on several devices"
    return None


def gate(events: Sequence) -> None:
    """Wait until the work the events were recorded after (the forward pass writing the
    pages) is done: the sidecar's copies must not start earlier."""
    for event in events:
        event.synchronize()


@dataclass
class DevicePool:
    """One device pool registered with the sidecar as a cuda_ipc buffer (once)."""

    namespace: str
    views: list
    span: int
    buffer_id: str | None = None

    @property
    def slots(self) -> int:
        return min(v.shape[0] for v in self.views)

    def register(self, client: SidecarClient) -> str:
        """Register the pool's tensors as one buffer (one region per allocation, one chunk per
        tensor, slot i = page i) unless done already; its buffer id."""
        if self.buffer_id is None:
            from api.engine.cuda_export import register_cuda  # cuda-python: GPU engines only

            self.buffer_id = register_cuda(client, self.namespace, self.views, self.slots)
        return self.buffer_id

    def forget(self) -> None:
        """The sidecar lost the registration (a restart): register again at the next use."""
        self.buffer_id = None

    def release(self, client: SidecarClient) -> None:
        if self.buffer_id is not None:
            with contextlib.suppress(SidecarError):  # gone with a restarted sidecar
                client.release_buffer(self.namespace, self.buffer_id)
            self.buffer_id = None

    def item(self, keys: Sequence[str], rows: Sequence[int]) -> dict:
        """A batch/set or batch/get item moving `keys` from / to the pages at `rows`."""
        assert self.buffer_id is not None, "register the pool first"
        return {
            "namespace": self.namespace,
            "keys": list(keys),
            "buffer_id": self.buffer_id,
            "slots": page_numbers(rows, self.span),
        }


def direct_pool(
    namespace: str, views: list, span: int, buffers: Sequence[torch.Tensor]
) -> DevicePool | None:
    """A DevicePool for these page views of `buffers`, or None (logged) when they need staging."""
    why = can_go_direct(views, buffers)
    if why is not None:
        if views and views[0].is_cuda:
            log.info("kv-sidecar linker: %s goes through staging (%s)", namespace, why)
        return None
    return DevicePool(namespace, list(views), span)
