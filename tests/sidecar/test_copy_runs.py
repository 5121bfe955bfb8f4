"""Runs per page (issue 54): a plan merges a request's pages where both its engine slots and
its host slots are adjacent (the pool places a request's pages in a row), and `/v1/stats`
`copies` counts the pages moved and the runs their plans had (docs/api-additions.md)."""

from __future__ import annotations

from api.engine.shm import SharedBuffer, page_first_chunks
from pools.page_pool import PagePool
from sidecar.transports.base import Chunk, build_plan

PAGE = 4096
TOKEN = "copy-runs-token"


def spread(n: int, slots: int = 64) -> list[int]:
    return [i * 37 % slots for i in range(n)]  # no two in a row: scattered block ids


def runs_per_page(engine_slots: list[int], host_offsets: list[int]) -> float:
    pages = list(zip(host_offsets, engine_slots, strict=True))
    return len(build_plan((Chunk(0, PAGE, PAGE),), [1 << 40], pages, False)) / len(pages)


def test_the_pools_placement_merges_a_request_into_one_run():
    pool = PagePool("p", PAGE, 256 * PAGE, max_pages=256)
    pool.add_segment(0)
    first = [pool.reserve(f"a{i}").offset for i in range(64)]
    assert runs_per_page(list(range(64)), first) == 1 / 64
    for i in range(64):  # a request given back out of order (a failed copy's aborts)
        pool.abort(pool.entries[f"a{(i * 37) % 64}"])
    again = [pool.reserve(f"b{i}").offset for i in range(64)]
    assert runs_per_page(list(range(64)), again) == 1 / 64
    assert runs_per_page(list(range(64)), list(reversed(again))) == 1  # a stack's order
    assert runs_per_page(spread(64), again) == 1  # engine pages scattered: no merge
    pool.invariants()


def test_copies_count_pages_and_runs(make_server):
    srv = make_server(token=TOKEN)
    engine = srv.client()
    engine.put_namespace("kv", PAGE)
    buf = SharedBuffer(64 * PAGE)
    try:
        bid = buf.register(engine, "kv", 64, page_first_chunks(PAGE))
        assert all(engine.set("kv", [f"a{i}" for i in range(64)], bid, list(range(64))))
        copies = srv.tcp_client().stats()["copies"]
        assert (copies["moves"], copies["pages"], copies["runs"]) == (1, 64, 1)
        assert all(engine.set("kv", [f"b{i}" for i in range(32)], bid, spread(32)))
        assert all(engine.get("kv", [f"a{i}" for i in range(64)], bid, list(range(64))))
        copies = srv.tcp_client().stats()["copies"]
        assert (copies["moves"], copies["pages"], copies["runs"]) == (3, 160, 1 + 32 + 1)
    finally:
        buf.close()
