from api.cli.lru_sim import LruSim


def test_request_semantics():
    s = LruSim(3)
    assert s.request(["a", "b"]) == 0  # miss: a, b stored
    assert s.request(["a", "b", "c"]) == 2  # hits a, b; c stored
    assert s.request(["d"]) == 0  # full: evicts a (least recent)
    assert list(s.lru) == ["b", "c", "d"] and s.evictions == 1
    assert s.request(["c", "x", "b"]) == 1  # c touched; x evicts b, then b evicts d
    assert list(s.lru) == ["c", "x", "b"] and s.evictions == 3


def test_exists_does_not_touch_and_batch_keys_are_not_evictable():
    s = LruSim(2)
    s.request(["a", "b"])
    assert s.prefix(["a"]) == 1
    assert list(s.lru) == ["a", "b"]
    assert s.set(["x", "y", "z"]) == [True, True, False]  # z finds no evictable page
    assert list(s.lru) == ["x", "y"]
