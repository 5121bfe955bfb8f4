"""Types of sidecar/_evpack.c, KV events' packer (a C extension mypy cannot read)."""

def hex_array(keys: list, a: int, b: int, /) -> bytes | None:
    """msgpack array of bin items from the hex keys[a:b]; None where a key is not hex."""

def flat_ints(lists: list, a: int, b: int, /) -> bytes | None:
    """msgpack array of the ints of lists[a:b] in order; None where one is not an int."""
