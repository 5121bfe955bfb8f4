"""Types of sidecar/_kvcopy.c, a copy plan's runs without the GIL (a C extension mypy
cannot read)."""

def run_plan(plan: list[tuple[int, int, int]], stream_min: int, /) -> int:
    """Copy each (dst, src, nbytes) run with the GIL released (non-temporal stores for a
    plan of `stream_min` bytes or more); the bytes moved."""
