"""Page keys: 1-128 characters of [0-9A-Za-z_.:-]. A batch is checked in a few C passes."""

from __future__ import annotations

import re
import string

from sidecar.errors import BadRequest, InvalidKey, PayloadTooLarge

MAX_BATCH = 4096
MAX_KEY = 128
_KEY = re.compile(r"[0-9A-Za-z_.:\-]{1,128}")
_ALLOWED = (string.ascii_letters + string.digits + "_.:-").encode()
_SEPARATORS = b"\n" * MAX_BATCH


def check_key(key: object) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        shown = repr(key[:140]) if isinstance(key, str) else f"{type(key).__name__} {str(key)[:40]}"
        raise InvalidKey(f"key {shown} must be a string of 1-128 characters of [0-9A-Za-z_.:-]")
    return key


def _batch_ok(keys: list) -> bool:
    """True when every key is valid: ASCII of the allowed set, 1-128 long, no newline inside.

    Joined with newlines, deleting the allowed characters must leave exactly the n-1
    separators. Keys of one length (hashes: the usual case) then show as separators at
    every (L+1)th byte, which one C slice checks; otherwise every length is checked."""
    try:
        raw = "\n".join(keys).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        return False
    n, size = len(keys), len(keys[0])
    if raw.translate(None, _ALLOWED) != _SEPARATORS[: n - 1]:
        return False
    stride = 0 < size <= MAX_KEY and len(raw) == n * (size + 1) - 1
    if stride and raw[size :: size + 1] == _SEPARATORS[: n - 1]:
        return True
    # mixed lengths (some can sum to the stride's total: ["ab", "a", "abc"])
    return all(keys) and max(map(len, keys)) <= MAX_KEY


def check_batch(keys: object, field: str = "keys") -> list:
    """A JSON list of at most MAX_BATCH entries (the entries are not checked)."""
    if not isinstance(keys, list):
        raise BadRequest(f"'{field}' must be a list of strings")
    if len(keys) > MAX_BATCH:
        raise PayloadTooLarge(f"'{field}' holds {len(keys)} keys; at most {MAX_BATCH} a batch")
    return keys


def check_keys(keys: object, field: str = "keys") -> list[str]:
    """Validate a JSON list of keys; raise BadRequest / InvalidKey / PayloadTooLarge."""
    keys = check_batch(keys, field)
    if keys and not _batch_ok(keys):
        for k in keys:
            check_key(k)
    return keys
