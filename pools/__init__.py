"""Host memory for kv-sidecar: the shared arena, fixed-size page slots, the key index.

This package imports neither `sidecar` nor `api`, and never touches CUDA.
"""

from pools.arena import Arena
from pools.host_pool import HostPool, PoolFull
from pools.page_pool import Entry, PagePool, PoolInvariantError

__all__ = ["Arena", "Entry", "HostPool", "PagePool", "PoolFull", "PoolInvariantError"]
