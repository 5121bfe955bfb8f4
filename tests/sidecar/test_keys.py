"""The batch key check (a few C passes) agrees with the one-key check on every list."""
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.errors import InvalidKey
from sidecar.keys import _batch_ok, check_key

# allowed characters, the separator the batch check joins with, and a few outsiders
chars = st.sampled_from("aZ09_.:-\n /é\x00")
key = st.one_of(st.text(chars, max_size=4), st.integers(126, 130).map(lambda n: "a" * n),
                st.text(chars, min_size=126, max_size=130), st.none(), st.integers())


def valid(k) -> bool:
    try:
        check_key(k)
        return True
    except InvalidKey:
        return False


@settings(max_examples=500, deadline=None, database=None)
@given(st.lists(key, min_size=1, max_size=6))
def test_batch_check_matches_the_key_check(keys):
    assert _batch_ok(keys) == all(valid(k) for k in keys)


def test_examples():
    assert _batch_ok(["a" * 128, "0-9._:A"])
    for bad in (["", "a"], ["a", ""], [""], ["a\nb"], ["a", "b\n"], ["a" * 129], ["é"], [None]):
        assert not _batch_ok(bad), bad
