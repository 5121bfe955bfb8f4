"""Page keys: 1-128 characters of [0-9A-Za-z_.:-]. Checked in one regex pass per batch."""
from __future__ import annotations

import re

from sidecar.errors import BadRequest, InvalidKey, PayloadTooLarge

MAX_BATCH = 4096
_KEY = re.compile(r"[0-9A-Za-z_.:\-]{1,128}")
_KEYS = re.compile(r"(?:[0-9A-Za-z_.:\-]{1,128}\n)*")


def check_key(key: object) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        shown = repr(key[:140]) if isinstance(key, str) else f"{type(key).__name__} {str(key)[:40]}"
        raise InvalidKey(f"key {shown} must be a string of 1-128 characters of [0-9A-Za-z_.:-]")
    return key


def check_keys(keys: object, field: str = "keys") -> list[str]:
    """Validate a JSON list of keys; raise BadRequest / InvalidKey / PayloadTooLarge."""
    if not isinstance(keys, list):
        raise BadRequest(f"'{field}' must be a list of strings")
    if len(keys) > MAX_BATCH:
        raise PayloadTooLarge(f"'{field}' holds {len(keys)} keys; at most {MAX_BATCH} a batch")
    try:
        joined = "\n".join(keys) + "\n" if keys else ""
    except TypeError:
        joined = None
    # the separator count catches a key with a newline inside it
    if joined is None or joined.count("\n") != len(keys) or not _KEYS.fullmatch(joined):
        for k in keys:
            check_key(k)
    return keys
