"""The batch hit rule against a literal transcription of SGLang's batch_exists_v2."""
import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from pools import Arena, HostPool
from sidecar.hybrid import ExtraPool, batch_exists, boundary
from sidecar.spec import parse_spec
from sidecar.buffers import Sources
from sidecar.store import Store


def reference(keys, kv_present, pools):
    """SGLang, mem_cache/hicache_storage.py (reference doc section 1), step by step."""
    kv_pages = 0
    for k in keys:
        if k not in kv_present:
            break
        kv_pages += 1
    final = kv_pages
    for present, policy, window in pools:
        if final == 0:
            break
        if present is None:  # never registered
            final = 0
            continue
        if policy == "all_pages":
            b = kv_pages
            for i in range(kv_pages):
                if keys[i] not in present:
                    b = i
                    break
        else:
            b = 0
            for prefix_len in range(kv_pages, 0, -1):
                lo = max(0, prefix_len - window)
                if all(keys[j] in present for j in range(lo, prefix_len)):
                    b = prefix_len
                    break
        final = min(final, b)
    return kv_pages, final


def make_store():
    arena = Arena(4 << 20)
    return Store(HostPool(arena, 64 << 10), None, Sources(["/dev/shm"])), arena


def fill(store, name, keys):
    store.put_namespace(name, parse_spec({"page_bytes": 64}))
    pool = store.namespace(name).pool
    for k in keys:
        pool.commit(pool.reserve(k))


KEYS = [f"{i:064x}" for i in range(24)]
pool_strategy = st.tuples(
    st.one_of(st.none(), st.sets(st.integers(0, 23))),
    st.sampled_from(["all_pages", "trailing_pages"]),
    st.integers(1, 6))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 24), kv=st.sets(st.integers(0, 23)), pools=st.lists(pool_strategy, max_size=4))
def test_batch_exists_matches_reference(n, kv, pools):
    store, arena = make_store()
    try:
        keys = KEYS[:n]
        fill(store, "kv", [KEYS[i] for i in kv])
        extra, ref_pools = [], []
        for j, (present, policy, window) in enumerate(pools):
            name = f"p{j}"
            if present is not None:
                fill(store, name, [KEYS[i] for i in present])
            extra.append(ExtraPool(name, policy, window))
            ref_pools.append((None if present is None else {KEYS[i] for i in present}, policy, window))
        got = asyncio.run(batch_exists(store, keys, "kv", extra))
        kv_pages, final = reference(keys, {KEYS[i] for i in kv}, ref_pools)
        assert (got["kv"], got["hit"]) == (kv_pages, final)
        assert set(got["pools"]) == {f"p{j}" for j in range(len(pools))}
    finally:
        arena.close()


def test_boundary_examples():
    p = [False, False, True, False, True, False]
    assert boundary(p, 5, "trailing_pages", 1) == 5
    assert boundary(p, 4, "trailing_pages", 1) == 3
    assert boundary(p, 2, "trailing_pages", 1) == 0
    swa = [True, True, True, False, True, False]
    assert boundary(swa, 5, "trailing_pages", 2) == 3
    assert boundary(swa, 5, "trailing_pages", 9) == 3   # the window is cut at the root
    assert boundary([True, True, False, True, True], 5, "all_pages") == 2
    assert boundary([], 0, "all_pages") == 0
