"""The typed context of one running sidecar: built in the app's lifespan, closed at shutdown."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pools import Arena, HostPool
from sidecar import datadir, report
from sidecar.buffers import Quota, Sources
from sidecar.config import Config
from sidecar.controls import Keeper, PinStore
from sidecar.copier import Copier
from sidecar.leases import LeaseRegistry, LendServer, fd_socket_path
from sidecar.metrics import RequestStats
from sidecar.peer import bind_unix, group_id
from sidecar.samples import Sampler
from sidecar.store import Store
from sidecar.tenancy import OPERATOR, Caller
from sidecar.tiering import Tiering
from sidecar.tiers import hf3fs_tier
from sidecar.tiers.base import Tier
from sidecar.tiers.file_tier import FileTier
from sidecar.tiers.mooncake_tier import MooncakeSettings, MooncakeTier
from sidecar.tiers.writer import TierWriter
from sidecar.transports import cuda_ipc
from sidecar.turns import LoopMonitor

if TYPE_CHECKING:  # pyzmq and msgspec: the `events` extra
    from sidecar.events import Events

log = logging.getLogger("kv_sidecar")
REAP_INTERVAL = 1.0


def build_tiers(config: Config) -> list[Tier]:
    tiers: list[Tier] = []
    if config.file_tier:
        tiers.append(file_tier(config))
    if config.hf3fs_dir:
        group = group_id(config.hf3fs_group) if config.hf3fs_group else None
        node = hf3fs_tier.node_name(config.data_dir)  # a restart keeps its name
        tiers.append(hf3fs_tier.Hf3fsTier(config.hf3fs_dir, config.hf3fs_size or None, group, node))
    if config.mooncake_master:
        tiers.append(
            MooncakeTier(
                MooncakeSettings(
                    config.mooncake_master,
                    config.mooncake_metadata,
                    config.mooncake_protocol,
                    config.mooncake_device,
                    config.mooncake_segment_size,
                    local_hostname=config.mooncake_local_hostname,
                )
            )
        )
    return tiers


def file_tier(config: Config) -> FileTier:
    """The local file tier: `--file-tier-size`, or the default size, set when recovery has
    counted what the tier holds (one scan of its files, not two)."""
    if config.file_tier_size:
        log.info(
            "file tier %s: %d bytes (--file-tier-size)", config.data_dir, config.file_tier_size
        )
        return FileTier("file", config.data_dir, config.file_tier_size)
    tier = FileTier("file", config.data_dir, datadir.file_tier_size(config, held=0)[0])

    def sizer(held: int) -> int:
        size, why = datadir.file_tier_size(config, held)
        log.info("file tier %s: %d bytes (%s)", config.data_dir, size, why)
        return size

    tier.sizer = sizer
    return tier


@dataclass(slots=True, eq=False)
class Context:
    config: Config
    arena: Arena
    host_pool: HostPool
    store: Store
    executor: ThreadPoolExecutor
    requests: RequestStats = field(default_factory=RequestStats)
    sampler: Sampler = field(default_factory=Sampler)
    monitor: LoopMonitor = field(default_factory=LoopMonitor)  # the longest loop turn
    started: float = field(default_factory=time.time)
    cuda_registered: bool = False
    ready: bool = False
    _loop: asyncio.AbstractEventLoop | None = None
    lend_server: LendServer | None = None
    events: Events | None = None  # with --kv-events
    _tasks: list = field(default_factory=list)

    @classmethod
    def build(cls, config: Config) -> Context:
        """Check the tier directories (UnusableDir), then allocate and prefault the host
        pool (the slow part of start-up)."""
        datadir.check_dirs(config)
        arena = Arena(config.host_pool)
        host_pool = HostPool(arena, config.effective_segment_size)
        executor = ThreadPoolExecutor(config.copy_threads, thread_name_prefix="kv-copy")
        tiers = build_tiers(config)
        writer = TierWriter(tiers, config.tier_threads, config.write_queue_pages) if tiers else None
        tiering = Tiering(
            tiers, config.write_policy, writer, host_pool, executor, config.copy_threads
        )
        cuda = cuda_ipc.CudaIpc.create()
        st = os.fstat(arena.fd)
        own = ((st.st_dev, st.st_ino),)  # the arena: never registrable, never lendable
        sources = Sources(
            config.shm_dirs,
            LeaseRegistry(own),
            cuda,
            Quota(config.max_mapped, config.max_mapped_per_uid),
        )
        parallel = min(config.copy_threads, os.cpu_count() or 1)
        store = Store(host_pool, executor, sources, parallel, tiering)
        store.copier = Copier(config.copy_threads, parallel, config.copy_deadline)
        # TCP without a tenant's token is the operator when its token is set; with no
        # credential configured at all, TCP is anyone on the node (the anonymous tenant)
        store.operator_tcp = config.token is not None
        if config.file_tier:  # operators' pins kept across a restart (sidecar/controls/keeper.py)
            saved = PinStore(os.path.join(config.data_dir, "pins"))
            store.controls.keeper = Keeper(store.controls, saved)
        ctx = cls(config, arena, host_pool, store, executor)
        for tier in tiers:
            tier.attach(arena.address, arena.size)
        ctx.cuda_registered = cuda is not None and cuda_ipc.register_host_memory(
            arena.address, arena.size
        )
        log.info(
            "host pool: %d bytes in %d segments of %d bytes (cuda registered: %s); "
            "tiers: %s, write policy %s",
            arena.size,
            host_pool.n_segments,
            host_pool.segment_size,
            ctx.cuda_registered,
            [t.name for t in tiers] or "none",
            tiering.policy,
        )
        return ctx

    @property
    def tiering(self) -> Tiering:
        return self.store.tiering

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop `start` ran on; every caller runs after it."""
        assert self._loop is not None, "used before start"
        return self._loop

    def start(self) -> None:
        """Start background work (from the running loop); ready once the tiers are recovered."""
        self._loop = asyncio.get_running_loop()
        self.monitor.start(self._loop)
        if self.config.socket:
            path = fd_socket_path(self.config.socket)
            sock = bind_unix(
                path, self.config.socket_mode, self.config.socket_group, socket.SOCK_SEQPACKET
            )
            self.lend_server = LendServer(
                self.store.sources.leases, sock, path, self.config.lend_idle_timeout
            )
            self.lend_server.start(self.loop)
        if self.tiering.writer is not None:
            self.tiering.writer.start()
        if self.config.kv_events:
            from sidecar import events  # pyzmq and msgspec: the `events` extra

            self.events = self.store.events = events.start(
                self.config, self.loop, self.tiering.tiers
            )
        self._tasks.append(self.loop.create_task(self._recover_then_serve()))
        self._tasks.append(self.loop.create_task(self._reaper()))
        sample = self.sampler.run(lambda: report.sample(self.store), lambda: self.requests.count)
        self._tasks.append(self.loop.create_task(sample))
        # what start-up built (modules, the app, the pools) lives as long as the process:
        # keep it out of every later collection (a full one paused the loop 100-270 ms)
        gc.collect()
        gc.freeze()

    async def _recover_then_serve(self) -> None:
        for tier in self.tiering.tiers:
            t0 = time.perf_counter()
            try:
                pages = await self.loop.run_in_executor(None, tier.recover)
            except OSError as exc:  # checked at start, so rare: the tier serves misses
                tier.degraded = f"recovery failed: {exc.strerror or exc}"
                log.error(
                    "%s tier %s: recovery failed: %s; it starts empty", tier.name, tier.where, exc
                )
                continue
            log.info(
                "%s tier %s: %d pages recovered in %.2f s",
                tier.name,
                tier.where,
                pages,
                time.perf_counter() - t0,
            )
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

    async def flush(self, timeout: float, who: Caller = OPERATOR) -> int:
        return await self.store.flush(timeout, who)

    async def close(self, timeout: float | None = None) -> None:
        """Phases: stop answering ready, stop background tasks, flush queued tier writes,
        finish copies, unmap. Each phase is bounded by the shutdown timeout."""
        timeout = timeout or self.config.shutdown_timeout
        self.ready = False
        self.monitor.stop()
        if self.lend_server is not None:
            self.lend_server.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        pending = await self.flush(timeout)
        if pending:
            log.error(
                "shutdown: %d pages not written to the tiers within %.1f s "
                "(--shutdown-timeout); they are lost",
                pending,
                timeout,
            )
        elif self.tiering.writer is not None:
            log.info("shutdown: every page is written to the tiers")
        drain = self.loop.run_in_executor(None, self.executor.shutdown, True)
        try:
            await asyncio.wait_for(drain, timeout)
        except TimeoutError:
            log.warning("copy workers did not finish within the shutdown timeout")
        if not await self.tiering.close_reads(min(timeout, 5.0)):
            log.warning("tier reads did not finish within the shutdown timeout")
        copying = not await self.store.copier.lanes.idle(min(timeout, 5.0))
        if copying:  # a copy stuck in an engine's memory may still write into the arena
            log.warning(
                "shutdown: %d copies are stuck in engine memory; the host pool stays "
                "mapped until the process exits",
                self.store.copier.lanes.busy,
            )
        if self.tiering.writer is not None:
            await self.loop.run_in_executor(None, self.tiering.writer.stop, timeout)
        for tier in self.tiering.tiers:
            await self.loop.run_in_executor(None, tier.close)
        await self.store.controls.close(timeout)  # the pins stay kept: no delete below
        for ns in list(self.store.namespaces.values()):
            self.store.delete_namespace(ns.ref)
        if self.events is not None:
            self.events.flush()
            self.events.publisher.close()
        self.store.copier.lanes.close()
        self.store.sources.leases.lanes.close()  # after the closes queued above
        if not copying:
            self.arena.close()
