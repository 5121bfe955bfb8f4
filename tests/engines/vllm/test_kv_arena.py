"""The KV cache in the connector's memfd (KvArena): what it allocates there, how the KV
buffer is described to the sidecar, and loads straight into the KV blocks through a real
sidecar (no staging)."""

import hashlib

import torch

from api.engine.client import SidecarClient
from api.engine.vllm_layout import EngineScope, PageLayout, namespace_spec
from api.engine.vllm_scheduler import Transfer
from api.engine.vllm_worker import KvArena, WorkerSide, kv_chunks

N, BS, L = 48, 32, 3
LAYER = N * 2 * BS * 64 * 4  # one layer's blocks: [N, 2 heads, 32, 64] float32


def arena_cache(block_major: bool):
    """vLLM's one allocation, viewed per layer: layer-major (LBHNC, CPU_ATTN's) or block-major."""
    with KvArena() as arena:
        raw = torch.zeros(L * LAYER, dtype=torch.int8)
        private = torch.ones(L * LAYER, dtype=torch.int8)  # not a zeros: private memory
        small = torch.zeros(16)
    if block_major:
        page = LAYER // N
        caches = {
            f"l{i}": torch.as_strided(raw, (N, page), (L * page, 1), i * page)
            .view(torch.float32)
            .view(N, 2, BS, 64)
            for i in range(L)
        }
    else:
        caches = {
            f"l{i}": raw[i * LAYER : (i + 1) * LAYER].view(torch.float32).view(N, 2, BS, 64)
            for i in range(L)
        }
    return arena, raw, private, small, caches


def test_the_kv_allocation_lands_in_a_memfd():
    arena, raw, private, small, caches = arena_cache(False)
    (buf,) = arena.buffers  # the large zeros only
    assert raw.data_ptr() == buf.address and buf.size == L * LAYER and not raw.any()
    assert not (buf.address <= private.data_ptr() < buf.address + buf.size)
    layout = PageLayout.of(caches, N)
    assert arena.holding(layout.views) is buf
    assert arena.holding(PageLayout.of({"x": torch.zeros(N, 2, BS, 64)}, N).views) is None
    chunks = kv_chunks(layout, buf)
    assert [c["offset"] for c in chunks] == [i * LAYER for i in range(L)]
    assert {(c["stride"], c["size"]) for c in chunks} == {(LAYER // N, LAYER // N)}
    # a layout that keeps a block's layers together is one chunk a page
    arena2, _, _, _, caches2 = arena_cache(True)
    layout2 = PageLayout.of(caches2, N)
    assert kv_chunks(layout2, arena2.buffers[0]) == [
        {"offset": 0, "stride": layout2.page_bytes, "size": layout2.page_bytes}
    ]


def test_loads_go_straight_into_the_kv_blocks(server):
    scope = EngineScope(
        "m",
        "f32",
        BS,
        "CPU_ATTN",
        "sha256/32",
        {"tp": 0, "tp_size": 1, "pp": 0, "pp_size": 1, "cp": 0, "cp_size": 1},
    )
    src = {
        f"l{i}": torch.randn(N, 2, BS, 64, generator=torch.Generator().manual_seed(i))
        for i in range(L)
    }
    src_layout = PageLayout.of(src, N)
    spec = namespace_spec(scope, src_layout)
    saver = WorkerSide(SidecarClient(server.socket_url), src_layout, spec, 8)  # holds the save
    keys = [hashlib.sha256(f"d{i}".encode()).hexdigest() for i in range(5)]
    saver.save([Transfer("s", keys, [1, 2, 3, 4, 5])])  # through staging, the usual save
    saver.drain()
    arena, raw, _, _, caches = arena_cache(False)
    layout = PageLayout.of(caches, N)
    assert namespace_spec(scope, layout) == spec  # the same pages, wherever they live
    w = WorkerSide(SidecarClient(server.socket_url), layout, spec, 4, arena.holding(layout.views))
    assert w.direct and w.slots.capacity == 4
    w.load([Transfer("r", keys + [hashlib.sha256(b"absent").hexdigest()], [7, 8, 9, 10, 11, 0])])
    assert w.take_load_errors() == {0} and w.stats["loaded"] == 5
    for name in src:
        for d, s in zip([7, 8, 9, 10, 11], [1, 2, 3, 4, 5], strict=True):
            assert torch.equal(caches[name][d], src[name][s])
        assert not caches[name][0].any()
    ns = server.client().stats()["namespaces"][w.namespace]
    assert (
        ns["buffers"] == 2 and ns["hits"] == 5
    )  # the saver's staging, w's KV cache (its staging: lazy)
    # the sidecar restarts: the KV buffer is registered again on the next load
    w.kv_buffer_id = "b-gone"
    w.load([Transfer("r", keys[:1], [6])])
    assert not w.take_load_errors() and torch.equal(caches["l0"][6], src["l0"][1])
    saver.close()
    w.close()
