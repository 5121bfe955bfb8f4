"""The typed context of one running sidecar: built in the app's lifespan, closed at shutdown."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from pools import Arena, HostPool
from sidecar.config import Config
from sidecar.metrics import RequestStats
from sidecar.store import Store
from sidecar.transports import cuda_ipc

log = logging.getLogger("kv_sidecar")
REAP_INTERVAL = 1.0


@dataclass(slots=True, eq=False)
class Context:
    config: Config
    arena: Arena
    host_pool: HostPool
    store: Store
    executor: ThreadPoolExecutor
    requests: RequestStats = field(default_factory=RequestStats)
    started: float = field(default_factory=time.time)
    cuda_registered: bool = False
    ready: bool = False
    loop: Optional[asyncio.AbstractEventLoop] = None
    _tasks: list = field(default_factory=list)

    @classmethod
    def build(cls, config: Config) -> "Context":
        """Allocate and prefault the host pool (the slow part of start-up)."""
        arena = Arena(config.host_pool)
        host_pool = HostPool(arena, config.effective_segment_size)
        executor = ThreadPoolExecutor(config.copy_threads, thread_name_prefix="kv-copy")
        store = Store(host_pool, executor, config.shm_dirs, min(config.copy_threads, 2))
        ctx = cls(config, arena, host_pool, store, executor)
        ctx.cuda_registered = cuda_ipc.register_host_memory(arena.address, arena.size)
        log.info("host pool: %d bytes in %d segments of %d bytes (cuda registered: %s)",
                 arena.size, host_pool.n_segments, host_pool.segment_size, ctx.cuda_registered)
        return ctx

    def start(self) -> None:
        """Start background tasks (call from the running loop) and mark ready."""
        self.loop = asyncio.get_running_loop()
        self._tasks.append(self.loop.create_task(self._reaper()))
        self.ready = True

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            for buffer_id in self.store.reap_dead_buffers():
                log.info("released buffer %s: its process exited", buffer_id)

    async def close(self, timeout: Optional[float] = None) -> None:
        """Phases: stop answering ready, stop background tasks, finish copies, unmap."""
        self.ready = False
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        drain = loop.run_in_executor(None, self.executor.shutdown, True)
        try:
            await asyncio.wait_for(drain, timeout or self.config.shutdown_timeout)
        except asyncio.TimeoutError:
            log.warning("copy workers did not finish within the shutdown timeout")
        for name in list(self.store.namespaces):
            self.store.delete_namespace(name)
        self.arena.close()
