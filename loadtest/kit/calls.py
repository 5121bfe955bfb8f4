"""What tests and red-team attacks share to read a client call's outcome."""

from __future__ import annotations

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
