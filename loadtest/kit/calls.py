"""Small helpers tests and red-team attacks share: the status a client call met, and the
bytes of a page named by a key (deterministic, different for every key)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from api.engine.client import SidecarError


def status(call: Callable[[], Any]) -> int:
    """The HTTP status `call` (a client call) met: its error's, or 200."""
    try:
        call()
    except SidecarError as exc:
        return exc.status
    return 200


def page_bytes(key: str, size: int = 4096) -> bytes:
    """`size` bytes that only `key` gives (SHAKE-256 of the key)."""
    return hashlib.shake_256(key.encode()).digest(size)
