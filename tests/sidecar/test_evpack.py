"""KV events' packer (sidecar/_evpack.c, through sidecar/events.py's `hash_array` and
`token_array`): where it answers, the bytes are msgspec's own for the lists the Python path
builds; where its input is not plain hex keys or int64 token ids it answers None and the
Python path takes over, so an event never depends on whether the packer was built."""

from __future__ import annotations

import functools
import operator
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import events

msgspec = pytest.importorskip("msgspec")
packer = events._evpack
needs_packer = pytest.mark.skipif(
    packer is None and not os.environ.get("KV_SIDECAR_CI"),
    reason="sidecar/_evpack.c not built (no C compiler at install)",
)
encode = msgspec.msgpack.Encoder().encode

HEX = st.text("0123456789abcdefABCDEF", min_size=1, max_size=80).filter(lambda s: len(s) % 2 == 0)
ODD_KEY = st.sampled_from(["", "a", "zz", "ab cd", "é" * 4, "0" * 512, "0x12", "Ab\n"])
INT = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from(
        [
            0,
            127,
            128,
            255,
            256,
            65535,
            65536,
            2**32 - 1,
            2**32,
            2**63 - 1,
            -1,
            -32,
            -33,
            -128,
            -129,
            -32768,
            -32769,
            -(2**31),
            -(2**31) - 1,
            -(2**63),
        ]
    ),
)


@needs_packer
def test_the_packer_is_built_where_ci_runs():
    assert packer is not None


@needs_packer
@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.one_of(HEX, HEX, HEX, ODD_KEY), max_size=20), data=st.data())
def test_hash_arrays_are_msgspecs_bytes_or_left_to_python(keys, data):
    a = data.draw(st.integers(0, len(keys)))
    b = data.draw(st.integers(a, len(keys)))
    out = packer.hex_array(keys, a, b)
    want = events.hashes(keys[a:b], "vllm")
    if out is not None:
        assert out == encode(want)
        assert all(isinstance(h, bytes) for h in want)
    else:  # a key not plain hex of an even length up to 510 digits
        assert any(
            not (
                isinstance(k, str)
                and k.isascii()
                and 0 < len(k) <= 510
                and len(k) % 2 == 0
                and all(c in "0123456789abcdefABCDEF" for c in k)
            )
            for k in keys[a:b]
        )
    assert encode(events.hash_array(keys, a, b, "vllm", msgspec.Raw)) == encode(want)


@needs_packer
@settings(max_examples=300, deadline=None)
@given(lists=st.lists(st.lists(INT, max_size=20), max_size=20), data=st.data())
def test_token_arrays_are_msgspecs_bytes_or_left_to_python(lists, data):
    a = data.draw(st.integers(0, len(lists)))
    b = data.draw(st.integers(a, len(lists)))
    flat = functools.reduce(operator.iadd, [list(x) for x in lists[a:b]], [])
    out = packer.flat_ints(lists, a, b)
    if out is not None:
        assert out == encode(flat)
    else:  # an id past int64 (msgspec's uint64 form)
        assert any(x > 2**63 - 1 for x in flat)
    assert encode(events.token_array(lists, a, b, msgspec.Raw)) == encode(flat)


@needs_packer
def test_what_the_packer_refuses_goes_by_python():
    assert packer.flat_ints([[1, True]], 0, 1) is None  # a bool is not a token id
    assert packer.flat_ints([[1], (2,)], 0, 2) is None  # a tuple is not a page's list
    assert packer.flat_ints([[1.0]], 0, 1) is None
    assert packer.flat_ints([[1]], 1, 0) is None and packer.flat_ints([[1]], 0, 2) is None
    assert packer.hex_array(["ab", 7], 0, 2) is None
    assert packer.hex_array(["ab"], -1, 1) is None
    assert packer.flat_ints([], 0, 0) == encode([]) and packer.hex_array([], 0, 0) == encode([])
    many = [[i] for i in range(70_000)]  # array 32 header
    assert packer.flat_ints(many, 0, 70_000) == encode(list(range(70_000)))


def test_an_event_is_the_same_with_or_without_the_packer(monkeypatch):
    keys = [f"{i:064x}" for i in range(40)] + ["not-hex"] + [f"{i:064X}" for i in range(3)]
    tokens = [[16 * i + t for t in range(16)] for i in range(len(keys))]

    def chain(fmt):
        ev = events.stored_event(
            events.hash_array(keys, 1, 44, "vllm", msgspec.Raw),
            events.block_hash(keys[0], "vllm"),
            events.token_array(tokens, 1, 44, msgspec.Raw),
            16,
            "CPU_PINNED",
            fmt,
        )
        gone = events.removed_event(
            events.hash_array(keys, 0, 40, "vllm", msgspec.Raw), "CPU_PINNED", fmt
        )
        return encode([1.0, [ev, gone]])

    built = {fmt: chain(fmt) for fmt in events.FORMATS}
    monkeypatch.setattr(events, "_evpack", None)
    assert {fmt: chain(fmt) for fmt in events.FORMATS} == built
    ts, (stored, removed) = msgspec.msgpack.decode(built["array"])
    assert stored[1][0] == bytes.fromhex(keys[1]) and stored[1][-1] == bytes.fromhex(keys[43])
    assert "not-hex" in stored[1] and stored[3] == sum(tokens[1:44], [])
    assert removed[1] == [bytes.fromhex(k) for k in keys[:40]]


@pytest.mark.parametrize("built", [True, False])
def test_a_sets_token_ids_are_checked_with_or_without_the_packer(monkeypatch, built):
    if not built:
        monkeypatch.setattr(events, "_evpack", None)
    elif packer is None:
        pytest.skip("sidecar/_evpack.c not built")
    tokens = [[1, 2], [3, 2**40]]
    parent, got, packed = events.set_meta({"keys": ["a", "b"], "parent": "z", "tokens": tokens})
    assert (parent, got) == ("z", tokens) and packed == (
        encode([1, 2, 3, 2**40]) if built else None
    )
    for bad in ([[1], [True]], [[1], [1.0]], [[1], (2,)], [[1], ["2"]], [[1]]):
        with pytest.raises(events.BadRequest):
            events.set_meta({"keys": ["a", "b"], "tokens": bad})
    assert (
        events.set_meta({"keys": ["a"], "tokens": [[2**64 - 1]]})[2] is None
    )  # past int64: Python's
