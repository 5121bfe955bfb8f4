"""The linker's lookup answers "recompute" when restoring a prefix would be slower than its
prefill (issue 44, api/engine/restore_cost.py), under SGLang's own UnifiedRadixCache on CPU
device pools against a live sidecar (loadtest/kit/sglang/linker.py), and the sidecar counts the skip."""

import pytest
from sglang.srt.mem_cache.hicache_storage import PoolName

from loadtest.kit.sglang import linker as lk
from loadtest.kit.sglang import pools as kit  # noqa: F401  SGLang's CPU settings first
from loadtest.kit.sglang.linker import P


@pytest.fixture
def engines(server):
    made = []

    def make(kind="kv", **extra):
        eng = lk.engine(server.socket_url, kind, **extra)
        lk.scramble(eng, seed=300 + len(made))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def lookup(eng, tokens) -> list[int]:
    answers = []
    real = eng.linker.lookup
    eng.linker.lookup = lambda rid, transfers: answers.append(real(rid, transfers)) or answers[-1]
    try:
        lk.match(eng, tokens)
    finally:
        del eng.linker.lookup
    return answers[-1]


def test_a_restore_slower_than_prefill_is_skipped_and_counted(server, engines):
    a = engines("kv")
    # b's prefill is (said to be) a trillion tokens a second: no measured restore beats it
    b = engines("kv", prefill_tokens_per_s=1e12)
    first, second = lk.tokens_of(4000, 5), lk.tokens_of(5000, 5)
    for seed, tokens in enumerate((first, second)):
        lk.compute(a, tokens, seed=40 + seed)
    lk.settle(a)
    assert lookup(b, first) == [1, 2, 3, 4, 5]  # no restore measured yet: optimistic
    req, _ = lk.match(b, first)
    got = lk.load(b, req)  # timed: the restore cost learns it
    assert got.failed == [] and got.tokens == 5 * P
    assert b.linker.cost.snapshot()["bytes_per_s"]["host"]
    assert lookup(b, second) == []  # slower than its prefill: recompute
    ns = server.client().stats()["namespaces"][b.linker.names[PoolName.KV]]
    assert (ns["restores_skipped"], ns["restore_pages_skipped"]) == (1, 5)


def test_without_a_prefill_rate_every_restore_loads(server, engines):
    a, b = engines("kv"), engines("kv")
    tokens, more = lk.tokens_of(6000, 4), lk.tokens_of(7000, 4)
    lk.compute(a, tokens, seed=50)
    lk.compute(a, more, seed=51)
    lk.settle(a)
    req, _ = lk.match(b, tokens)
    assert lk.load(b, req).failed == []
    assert lookup(b, more) == [1, 2, 3, 4]  # the linker never saw a prefill: load
