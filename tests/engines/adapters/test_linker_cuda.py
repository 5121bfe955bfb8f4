"""The SGLang linker's device path on a CPU machine (no SGLang, no GPU): the page geometry it
registers and the choice between CUDA IPC and staging. The GPU half is
tests/engines/adapters/test_linker_cuda_gpu.py (marked `gpu`)."""

import pytest
import torch

from api.engine.sglang_linker_cuda import (
    DevicePool,
    can_go_direct,
    direct_pool,
    page_numbers,
    page_views,
)


def mha_pool(tokens=40, heads=2, dim=8, layers=2):
    """K and V per layer as SGLang's MHA pool keeps them (rows = tokens)."""
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(-50, 50, (tokens, heads, dim), generator=g).to(torch.bfloat16)
        for _ in range(2 * layers)
    ]


def test_a_page_view_is_the_buffers_own_rows_of_that_page():
    bufs, span = mha_pool(), 8
    views = page_views(bufs, span)
    assert [v.shape for v in views] == [(5, span * 2 * 8 * 2)] * 4
    for b, v in zip(bufs, views, strict=True):
        assert v.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert v[3].numpy().tobytes() == b[3 * span : 4 * span].view(torch.uint8).numpy().tobytes()
        v[1].zero_()  # a write through the view lands in the pool itself
        assert not b[span : 2 * span].any()


def test_rows_past_the_last_whole_page_are_left_out():
    assert page_views(mha_pool(tokens=43), 8)[0].shape[0] == 5


def test_slots_are_page_numbers_of_sglangs_locations():
    assert page_numbers([0, 24, 8, 40], 8) == [0, 3, 1, 5]
    pool = DevicePool("ns", page_views(mha_pool(), 8), 8, buffer_id="b-1")
    assert pool.slots == 5
    assert pool.item(["a", "b"], [16, 32]) == {
        "namespace": "ns",
        "keys": ["a", "b"],
        "buffer_id": "b-1",
        "slots": [2, 4],
    }
    with pytest.raises(AssertionError):
        DevicePool("ns", pool.views, 8).item(["a"], [0])  # never before its registration


def test_what_cannot_go_direct_says_why():
    bufs = mha_pool()
    views = page_views(bufs, 8)
    assert can_go_direct(views, bufs) == "not on a CUDA device"
    assert direct_pool("ns", views, 8, bufs) is None
    copies = [v.clone() for v in views]  # a reshape that copied: the sidecar must never get it
    assert can_go_direct(copies, bufs) == "a buffer's pages are not a view of it"
    tiny = [torch.zeros(4, 4, dtype=torch.uint8)]
    assert can_go_direct(page_views(tiny, 2), tiny) == "a page of fewer than 512 bytes"
    wide = torch.zeros(16, 2, 256, dtype=torch.uint8)
    strided = [wide[:, 0]]  # every other half row: a page is not one run
    assert can_go_direct(page_views(strided, 2), strided) in (
        "a page of a buffer is not contiguous",
        "a buffer's pages are not a view of it",
    )
