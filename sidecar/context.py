"""The typed context of one running sidecar: built in the app's lifespan, closed at shutdown."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from pools import Arena, HostPool
from sidecar.config import Config
from sidecar.metrics import RequestStats
from sidecar.store import Store
from sidecar.tiering import Tiering
from sidecar.tiers.file_tier import FileTier
from sidecar.tiers.writer import TierWriter
from sidecar.transports import cuda_ipc

log = logging.getLogger("kv_sidecar")
REAP_INTERVAL = 1.0


def build_tiers(config: Config) -> list[FileTier]:
    tiers = []
    if config.file_tier:
        tiers.append(FileTier("file", config.data_dir, config.file_tier_size))
    if config.hf3fs_dir:
        tiers.append(FileTier("hf3fs", config.hf3fs_dir, config.hf3fs_size or None, shared=True))
    return tiers


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
        tiers = build_tiers(config)
        writer = TierWriter(tiers, config.tier_threads, config.write_queue_pages) if tiers else None
        tiering = Tiering(tiers, config.write_policy, writer, host_pool, executor)
        cuda = cuda_ipc.CudaIpc.create()
        store = Store(host_pool, executor, config.shm_dirs, min(config.copy_threads, os.cpu_count() or 1),
                      tiering, cuda)
        ctx = cls(config, arena, host_pool, store, executor)
        ctx.cuda_registered = cuda is not None and cuda_ipc.register_host_memory(arena.address, arena.size)
        log.info("host pool: %d bytes in %d segments of %d bytes (cuda registered: %s); "
                 "tiers: %s, write policy %s", arena.size, host_pool.n_segments,
                 host_pool.segment_size, ctx.cuda_registered,
                 [t.name for t in tiers] or "none", tiering.policy)
        return ctx

    @property
    def tiering(self) -> Tiering:
        return self.store.tiering

    def start(self) -> None:
        """Start background work (from the running loop); ready once the tiers are recovered."""
        self.loop = asyncio.get_running_loop()
        if self.tiering.writer is not None:
            self.tiering.writer.start()
        self._tasks.append(self.loop.create_task(self._recover_then_serve()))
        self._tasks.append(self.loop.create_task(self._reaper()))

    async def _recover_then_serve(self) -> None:
        for tier in self.tiering.tiers:
            t0 = time.perf_counter()
            pages = await self.loop.run_in_executor(None, tier.recover)
            log.info("%s tier %s: %d pages recovered in %.2f s", tier.name, tier.root, pages,
                     time.perf_counter() - t0)
        self.ready = True
        shared = [t for t in self.tiering.tiers if t.shared]
        while shared:
            await asyncio.sleep(self.config.hf3fs_rescan)
            for tier in shared:
                await self.loop.run_in_executor(None, tier.recover)

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            for buffer_id in self.store.reap_dead_buffers():
                log.info("released buffer %s: its process exited", buffer_id)

    async def flush(self, timeout: float) -> int:
        writer = self.tiering.writer
        return 0 if writer is None else await writer.flush(timeout)

    async def close(self, timeout: Optional[float] = None) -> None:
        """Phases: stop answering ready, stop background tasks, flush queued tier writes,
        finish copies, unmap. Each phase is bounded by the shutdown timeout."""
        timeout = timeout or self.config.shutdown_timeout
        self.ready = False
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        pending = await self.flush(timeout)
        if pending:
            log.warning("%d queued tier writes did not finish within %.0f s", pending, timeout)
        drain = self.loop.run_in_executor(None, self.executor.shutdown, True)
        try:
            await asyncio.wait_for(drain, timeout)
        except asyncio.TimeoutError:
            log.warning("copy workers did not finish within the shutdown timeout")
        if self.tiering.writer is not None:
            await self.loop.run_in_executor(None, self.tiering.writer.stop)
        for name in list(self.store.namespaces):
            self.store.delete_namespace(name)
        self.arena.close()
