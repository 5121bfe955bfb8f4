"""Every endpoint of API.md through a real uvicorn server on loopback."""

import hashlib
import os

import pytest
import torch

from api.engine.client import SidecarError
from api.engine.shm import SharedBuffer, page_first_chunks, tensor_chunks

PAGE = 4096


def pattern(key: str, size: int = PAGE) -> bytes:
    """Deterministic bytes for a key, so any mixed-up page is detected."""
    return hashlib.shake_256(key.encode()).digest(size)


@pytest.fixture
def ns(client, server):
    client.put_namespace("kv", PAGE, model="m", dtype="bfloat16", page_tokens=16)
    return "kv"


def test_health_ready_metrics_stats(client, server, ns):
    assert client.health() == {"status": "ok"}
    assert client.ready()
    client.put_page(ns, "a", pattern("a"))
    stats = client.stats()
    assert stats["namespaces"]["kv"]["pages"]["host"] == 1
    assert stats["namespaces"]["kv"]["bytes_in"] == PAGE
    text = client.metrics()
    assert 'kv_sidecar_pages{namespace="kv",tier="host"} 1.0' in text
    assert (
        'kv_sidecar_requests_total{method="PUT",route="/v1/namespaces/{name}/pages/{key}",status="201"}'
        in text
    )
    server.invariants()


def test_namespace_lifecycle(client, server):
    spec = {
        "pool": "kv",
        "model": "Qwen/Qwen3-8B",
        "layout": "page_first",
        "dtype": "bfloat16",
        "page_tokens": 64,
        "rank": {"tp": 1, "tp_size": 2},
    }
    status, body = client.request("PUT", "/v1/namespaces/q", {"page_bytes": PAGE, **spec})
    assert status == 201 and body["spec"]["rank"]["tp"] == 1
    # the same spec again, fields in another order: 200
    again = {
        "rank": {"tp_size": 2, "tp": 1},
        **dict(reversed(list(spec.items()))),
        "page_bytes": PAGE,
    }
    assert client.request("PUT", "/v1/namespaces/q", again)[0] == 200
    with pytest.raises(SidecarError) as exc:
        client.put_namespace("q", PAGE * 2, **spec)
    assert exc.value.status == 409 and exc.value.code == "conflict"
    assert [n["name"] for n in client.list_namespaces()] == ["q"]
    assert client.get_namespace("q")["spec"]["model"] == "Qwen/Qwen3-8B"
    client.put_page("q", "k", pattern("k"))
    client.delete_namespace("q")
    with pytest.raises(SidecarError) as exc:
        client.get_namespace("q")
    assert exc.value.status == 404
    client.put_namespace("q", PAGE)  # a new namespace under the old name starts empty
    assert client.exists("q", ["k"]) == 0
    server.invariants()


def test_inline_pages_and_exists(client, server, ns):
    assert client.put_page(ns, "a", pattern("a")) is True
    assert client.put_page(ns, "a", pattern("a")) is False  # present: 200
    client.put_page(ns, "b", pattern("b"))
    assert client.get_page(ns, "a") == pattern("a")
    assert client.get_page(ns, "zz") is None
    assert client.exists(ns, ["a", "b", "c", "a"]) == 2
    assert client.exists_each(ns, ["a", "c", "b"]) == [True, False, True]
    assert client.exists(ns, []) == 0
    assert client.delete(ns, ["a", "nope"]) == 1
    assert client.exists_each(ns, ["a", "b"]) == [False, True]
    server.invariants()


def test_set_get_through_shm_buffer(client, server, ns):
    slots = 32
    src = SharedBuffer(slots * PAGE)
    dst = SharedBuffer(slots * PAGE)
    keys = [f"p{i}" for i in range(20)]
    for i, k in enumerate(keys):
        src.view(i * PAGE, PAGE)[:] = pattern(k)
    bsrc = src.register(client, ns, slots, page_first_chunks(PAGE))
    bdst = dst.register(client, ns, slots, page_first_chunks(PAGE))
    assert client.set(ns, keys, bsrc, list(range(20))) == [True] * 20
    server.invariants()
    assert client.exists(ns, keys) == 20
    # get in reverse order into other slots
    rev = list(reversed(keys))
    loaded = client.get(ns, rev + ["missing"], bdst, list(range(21)))
    assert loaded == [True] * 20 + [False]
    for j, k in enumerate(rev):
        assert dst.view(j * PAGE, PAGE) == pattern(k)
    assert client.set(ns, keys[:3], bsrc, [5, 6, 7]) == [True] * 3  # present: no copy
    assert client.get_page(ns, "p0") == pattern("p0")  # bytes unchanged
    names = [
        b["buffer_id"] for b in client.request("GET", f"/v1/namespaces/{ns}/buffers")[1]["buffers"]
    ]
    assert sorted(names) == sorted([bsrc, bdst])
    client.release_buffer(ns, bsrc)
    with pytest.raises(SidecarError) as exc:
        client.set(ns, ["x"], bsrc, [0])
    assert exc.value.status == 404 and exc.value.code == "buffer_not_found"
    server.invariants()
    src.close(), dst.close()


def test_multi_chunk_layouts_round_trip(client, server):
    """K/V split (2 chunks) and layer_first (2 x layers chunks) of unequal sizes."""
    layers, slots = 3, 8
    sizes = [96, 160, 256]  # unequal per-layer bytes, like Mamba temporal + conv
    page = 2 * sum(sizes)
    client.put_namespace("lf", page, layout="layer_first")
    buf = SharedBuffer(2 * slots * sum(sizes))
    out = SharedBuffer(2 * slots * sum(sizes))
    tensors, outs, off = [], [], 0
    for _kv in range(2):
        for layer in range(layers):
            tensors.append(buf.tensor((slots, sizes[layer]), offset=off))
            outs.append(out.tensor((slots, sizes[layer]), offset=off))
            off += slots * sizes[layer]
    for t in tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    bid = buf.register(client, "lf", slots, tensor_chunks(buf, tensors))
    oid = out.register(client, "lf", slots, tensor_chunks(out, outs))
    keys = [f"s{i}" for i in range(slots)]
    assert client.set("lf", keys, bid, list(range(slots))) == [True] * slots
    perm = [3, 1, 7, 0, 2, 6, 5, 4]
    assert client.get("lf", keys, oid, perm) == [True] * slots
    for i, j in enumerate(perm):
        for t, o in zip(tensors, outs, strict=True):
            assert torch.equal(t[i], o[j])
    # the host page is the chunks in order: K layer 0..2, then V layer 0..2
    page_bytes = client.get_page("lf", "s2")
    expected = b"".join(buf.tensor_bytes(t[2]) for t in tensors)
    assert page_bytes == expected
    server.invariants()


def test_buffer_by_path_under_dev_shm(client, server, ns, tmp_path):
    path = f"/dev/shm/kv-sidecar-test-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(pattern("f0") + pattern("f1"))
    try:
        bid = client.register_buffer(ns, 2 * PAGE, 2, page_first_chunks(PAGE), path=path)
        assert client.set(ns, ["f0", "f1"], bid, [0, 1]) == [True, True]
        assert client.get_page(ns, "f1") == pattern("f1")
    finally:
        os.unlink(path)


def test_eviction_through_the_api(client, server):
    client.put_namespace("small", PAGE, host_capacity_bytes=3 * PAGE)
    for k in "abcd":
        client.put_page("small", k, pattern(k))
    assert client.exists_each("small", list("abcd")) == [False, True, True, True]
    assert client.stats()["namespaces"]["small"]["evictions"] == 1
    server.invariants()


def test_small_shm_get_refreshes_its_pages_and_pins_nothing(client, server):
    """A get small enough to copy on the event loop (issue 13) reads the pool without pins:
    it still marks its pages most recent in order, answers misses false, and leaves no pin."""
    client.put_namespace("small", PAGE, host_capacity_bytes=3 * PAGE)
    for k in "abc":
        client.put_page("small", k, pattern(k))
    out = SharedBuffer(4 * PAGE)
    try:
        bid = out.register(client, "small", 4, page_first_chunks(PAGE))
        assert client.get("small", ["b", "x", "a", "b"], bid, [0, 1, 2, 3]) == [
            True,
            False,
            True,
            True,
        ]
        assert [bytes(out.view(i * PAGE, PAGE)) for i in (0, 2, 3)] == [
            pattern("b"),
            pattern("a"),
            pattern("b"),
        ]
        pool = server.ns("small").pool
        assert server.on_loop(lambda: pool.busy) == 0
        client.put_page("small", "d", pattern("d"))  # c is least recent now, then a, then b
        assert client.exists_each("small", list("abcd")) == [True, True, False, True]
        client.put_page("small", "e", pattern("e"))
        assert client.exists_each("small", list("abde")) == [False, True, True, True]
    finally:
        out.close()
    server.invariants()


def test_exists_does_not_refresh_pages(client, server):
    """exists (count, each, batch) is a look-up: it never moves a page in the LRU, so the
    page asked about most is still the first one evicted (API.md)."""
    client.put_namespace("small", PAGE, host_capacity_bytes=3 * PAGE)
    for k in "abc":
        client.put_page("small", k, pattern(k))
    for _ in range(3):
        assert client.exists("small", ["a"]) == 1
        assert client.exists_each("small", ["a", "b"]) == [True, True]
        assert client.batch_exists(["a"], "small")["hit"] == 1
    client.put_page("small", "d", pattern("d"))
    assert client.exists_each("small", list("abcd")) == [False, True, True, True]
    assert client.get_page("small", "b") == pattern("b")  # a read does refresh: c goes next
    client.put_page("small", "e", pattern("e"))
    assert client.exists_each("small", list("bcde")) == [True, False, True, True]
    server.invariants()
