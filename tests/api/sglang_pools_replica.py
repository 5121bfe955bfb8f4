"""Host pools with SGLang 0.5.23's layouts, for CPU tests.

SGLang's own host pool classes (sglang.srt.mem_cache.pool_host.*) cannot be imported on a
CPU-only machine: they import the device pools, whose model configs import transformers and
torchvision (no CPU build). These replicas follow pool_host/mha.py, mla.py and mamba.py of
0.5.23 for what a storage backend touches: `kv_buffer` shapes per layout, `fd` (the shm
allocator's memfd), `get_page_buffer_meta`, `get_data_page`, `set_from_flat_data_page`.
"""
from __future__ import annotations

import torch

from api.engine.shm import SharedBuffer


class MHAHostPool:
    """layer_first (2, L, N, H, D); page_first (2, N, L, H, D); page_first_direct (2, N/P, L, P, H, D)."""

    def __init__(self, layout: str, size: int, page_size: int, layers: int = 3, heads: int = 2,
                 head_dim: int = 8, dtype=torch.bfloat16):
        self.layout, self.size, self.page_size = layout, size, page_size
        self.layer_num, self.head_num, self.head_dim, self.dtype = layers, heads, head_dim, dtype
        L, N, H, D, P = layers, size, heads, head_dim, page_size
        shape = {"layer_first": (2, L, N, H, D), "page_first": (2, N, L, H, D),
                 "page_first_direct": (2, N // P, L, P, H, D)}[layout]
        item = torch.empty((), dtype=dtype).element_size()
        self.mem = SharedBuffer(2 * L * N * H * D * item, "sglang-kv")
        self.kv_buffer = self.mem.tensor(shape, dtype)
        self.fd = self.mem.fd

    def get_page_buffer_meta(self, indices):
        it = self.dtype.itemsize
        L, N, H, D, P = self.layer_num, self.size, self.head_num, self.head_dim, self.page_size
        base, v_offset = self.kv_buffer.data_ptr(), L * N * H * D * it
        ptrs = []
        idx = indices.tolist()
        for i in range(0, len(idx), P):
            if self.layout == "layer_first":
                for layer in range(L):
                    k = base + idx[i] * H * D * it + layer * N * H * D * it
                    ptrs += [k, k + v_offset]
                size = it * P * H * D
            else:
                k = base + idx[i] * L * H * D * it
                ptrs += [k, k + v_offset]
                size = L * it * P * H * D
        return ptrs, [size] * len(ptrs)

    def _page(self, index):
        P = self.page_size
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index:index + P]
        if self.layout == "page_first":
            return self.kv_buffer[:, index:index + P]
        return self.kv_buffer[:, index // P]

    def get_data_page(self, index, flat: bool = True):
        page = self._page(index)
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index, data_page):
        page = self._page(index)
        page.copy_(data_page.view(self.dtype).reshape(page.shape) if data_page.dtype == torch.uint8
                   else data_page.reshape(page.shape))

    def page_bytes(self, page_index: int) -> bytes:
        """The bytes of one page, in get_data_page order (for comparisons)."""
        page = self.get_data_page(page_index * self.page_size).contiguous()
        return bytes(page.view(torch.uint8).tolist())


class MLAHostPool(MHAHostPool):
    """page_first (N, L, 1, dim): one pointer per page."""

    def __init__(self, size: int, page_size: int, layers: int = 3, dim: int = 24, dtype=torch.bfloat16):
        self.layout, self.size, self.page_size = "page_first", size, page_size
        self.layer_num, self.dim, self.dtype = layers, dim, dtype
        item = torch.empty((), dtype=dtype).element_size()
        self.mem = SharedBuffer(size * layers * dim * item, "sglang-mla")
        self.kv_buffer = self.mem.tensor((size, layers, 1, dim), dtype)
        self.fd = self.mem.fd

    def get_page_buffer_meta(self, indices):
        it, idx = self.dtype.itemsize, indices.tolist()
        ptrs = [self.kv_buffer.data_ptr() + idx[i] * self.layer_num * self.dim * it
                for i in range(0, len(idx), self.page_size)]
        return ptrs, [self.layer_num * it * self.page_size * self.dim] * len(ptrs)

    def _page(self, index):
        return self.kv_buffer[index:index + self.page_size]


class MambaHostPool:
    """page_size 1; temporal (N, layers, 1, *shape) and conv buffers, separate allocations:
    the pages span several mappings, so the backend copies them inline."""

    def __init__(self, size: int, layers: int = 2, temporal=(4, 6), convs=((3, 5), (2, 7))):
        self.layout, self.size, self.page_size, self.dtype = "page_first", size, 1, torch.float32
        self.mems = [SharedBuffer(size * layers * 4 * _n(temporal), "sglang-mamba-t")]
        self.temporal_buffer = self.mems[0].tensor((size, layers, 1, *temporal), torch.float32)
        self.conv_buffer = []
        for shape in convs:
            self.mems.append(SharedBuffer(size * layers * 2 * _n(shape), "sglang-mamba-c"))
            self.conv_buffer.append(self.mems[-1].tensor((size, layers, 1, *shape), torch.bfloat16))
        self.fd = self.mems[0].fd  # the first buffer only, as SGLang's allocator

    def _parts(self, index):
        return [self.temporal_buffer[index]] + [c[index] for c in self.conv_buffer]

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for i in indices.tolist():
            for part in self._parts(i):
                ptrs.append(part.data_ptr())
                sizes.append(part.numel() * part.element_size())
        return ptrs, sizes

    def get_data_page(self, index, flat: bool = True):
        return torch.cat([p.contiguous().view(torch.uint8).flatten() for p in self._parts(index)])

    def set_from_flat_data_page(self, index, data_page):
        off = 0
        for part in self._parts(index):
            n = part.numel() * part.element_size()
            part.view(torch.uint8).view(-1).copy_(data_page[off:off + n].view(-1))
            off += n

    def page_bytes(self, page_index: int) -> bytes:
        return bytes(self.get_data_page(page_index).tolist())


def _n(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
