"""The batch key check (a few C passes) agrees with the one-key check on every list."""

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.errors import InvalidKey
from sidecar.keys import _batch_ok, check_key

# allowed characters, the separator the batch check joins with, and a few outsiders
chars = st.sampled_from("aZ09_.:-\n /é\x00")
key = st.one_of(
    st.text(chars, max_size=4),
    st.integers(126, 130).map(lambda n: "a" * n),
    st.text(chars, min_size=126, max_size=130),
    st.none(),
    st.integers(),
)


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
    # mixed lengths whose total is the one-length stride's: valid, not a false refusal
    assert _batch_ok(["ab", "a", "abc"])
    assert _batch_ok(["a" * 3, "a" * 1, "a" * 5, "a" * 3])
    for bad in (["", "a"], ["a", ""], [""], ["a\nb"], ["a", "b\n"], ["a" * 129], ["é"], [None]):
        assert not _batch_ok(bad), bad


# keys of one length take the batch check's stride shortcut: newlines, outsiders and
# lengths just around the limit must still be caught there
same_length = st.integers(0, 130).flatmap(
    lambda n: st.lists(
        st.one_of(
            st.text(chars, min_size=n, max_size=n),
            st.text(st.sampled_from("aZ09_.:-"), min_size=n, max_size=n),
        ),
        min_size=1,
        max_size=6,
    )
)


@settings(max_examples=500, deadline=None, database=None)
@given(same_length)
def test_batch_check_of_keys_of_one_length(keys):
    assert _batch_ok(keys) == all(valid(k) for k in keys)


def test_one_length_examples():
    assert (
        _batch_ok(["ab", "cd", "ef"])
        and _batch_ok(["a" * 128] * 3)
        and _batch_ok(["ab", "c", "de"])
    )
    for bad in (
        ["ab", "c\n", "de"],
        ["a\nb", "cde"],
        ["a" * 129] * 2,
        ["", ""],
        ["ab", "c.", "d/"],
        ["abc", "d", "e\n"],
        ["a\n", "\nb"],
        ["a\nbc", "de", "fg"],
        ["aa", "", "aaaa"],
        ["a" * 100, "a" * 160, "a" * 40],
    ):  # same total as one length
        assert not _batch_ok(bad), bad
