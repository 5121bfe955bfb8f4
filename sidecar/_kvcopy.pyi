"""Types of sidecar/_kvcopy.c, a copy plan's runs without the GIL (a C extension mypy
cannot read)."""

def run_plan(plan: list[tuple[int, int, int]], stream_min: int, /) -> int:
    """Copy each (dst, src, nbytes) run with the GIL released (non-temporal stores for a
    plan of `stream_min` bytes or more); the bytes moved."""

def cuda_plan(
    plan: list[tuple[int, int, int]],
    stream: int,
    batch: int,
    abi: int,
    each: int,
    order: int,
    /,
) -> tuple[int, int, int]:
    """Hand each (dst, src, nbytes) run to the CUDA driver on `stream` with the GIL released:
    one `batch` call (cuMemcpyBatchAsync of ABI `abi`, source access `order`), else one
    `each` call (cuMemcpyAsync) a run; (bytes, CUresult, index of the failed run or -1)."""
