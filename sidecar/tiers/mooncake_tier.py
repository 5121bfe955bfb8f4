"""Mooncake Store as a tier: pages shared by every sidecar that uses one Mooncake master.

One page is one Mooncake object, keyed by the namespace identity the store hands over, so
two sidecars share a page exactly when their namespaces match:

    key "kvs/<identity>/<page key>"
    +-------------------------------+--------------------------------------+
    | header, 64 B (pagefile.py):   | page bytes (page length)             |
    | magic, length, xxh3 of page,  |                                      |
    | tag of the key, own xxh3      |                                      |
    +-------------------------------+--------------------------------------+
      ^ a registered header block     ^ the host slot itself (the arena is registered once):
                                        batch_put_from_multi_buffers / batch_get_into_multi_buffers

Zero copy: pages move straight between arena slots and the cluster; the only bytes Python
touches are the 64-byte headers. A page whose header or checksum is wrong is a miss.

Mooncake is a cache: it may evict any page at any time. Every failure (master down or
restarted, no space, an expired lease, a page evicted between exists and get) is a miss or
`False` with a counter and at most one log line per interval. The client connects in a
background thread, retrying until the master answers; until then the tier is empty.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import queue
import socket
import threading
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from sidecar.tiers import pagefile
from sidecar.tiers.base import RateLog, Tier, TierStats

log = logging.getLogger("kv_sidecar.tiers")
HEADER = pagefile.HEADER_SIZE
CHUNK = 64  # pages per Mooncake call, and headers per header block
BLOCKS = 32  # header blocks: concurrent calls (writer + copy threads)
STAGING = 64 * 2**20  # registered staging for pages outside the arena (write-back copies)
# Mooncake's ErrorCode values (mooncake-store/include/types.h)
NO_AVAILABLE_HANDLE, INVALID_PARAMS, OBJECT_NOT_FOUND = -200, -600, -704
OBJECT_ALREADY_EXISTS, LEASE_EXPIRED, REPLICA_IS_GONE, RPC_FAIL = -705, -707, -712, -900


@dataclass(frozen=True, slots=True)
class MooncakeSettings:
    master: str  # HOST:PORT of mooncake_master
    metadata: str = "P2PHANDSHAKE"  # or etcd://..., http://.../metadata
    protocol: str = "tcp"  # tcp or rdma
    device: str = ""  # RDMA device names, e.g. "mlx5_0,mlx5_1"
    segment_size: int = 2**30  # memory this sidecar lends the cluster (0: none)
    local_buffer_size: int = 16 * 2**20
    local_hostname: str = ""  # empty: the address this node uses to reach the master


@dataclass(slots=True)
class MooncakeStats(TierStats):
    unavailable: int = 0  # calls made while the master was down or unreachable
    no_space: int = 0  # writes refused: every segment full
    lease_expired: int = 0  # reads whose lease ran out before the bytes arrived
    evicted: int = 0  # pages gone between exists and get
    connects: int = 0


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"Mooncake master must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def route_address(host: str, port: int) -> str:
    """The local address the kernel would use to reach host:port (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _address(view) -> int | None:
    """The address of a writable buffer; None for a read-only one."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:  # read-only: a staged copy
        return None


def _mapped_address(mm: mmap.mmap) -> int:
    """The address of a mapping of ours (always writable)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


class MooncakeTier(Tier):
    """Pages in a Mooncake cluster; `contains` knows what this process wrote or read."""

    shared = True
    remote_lookup = True

    def __init__(self, settings: MooncakeSettings, name: str = "mooncake"):
        self.name = name
        self.settings = settings
        self.host, self.port = split_address(settings.master)
        self.where = settings.master
        self.stats: MooncakeStats = MooncakeStats()
        self.degraded: str | None = "connecting"
        self.known: dict[str, set[str]] = {}
        self._client: Any = None
        self._arena: tuple[int, int] | None = None
        self._blocks: queue.Queue = queue.Queue()
        self._headers: mmap.mmap | None = None
        self._staging: mmap.mmap | None = None
        self._staging_lock = threading.Lock()
        self._known_lock = threading.Lock()
        self._put_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logs = {k: RateLog() for k in ("unavailable", "write", "read", "corrupt")}

    # -- connection -------------------------------------------------------------------
    def attach(self, address: int, size: int) -> None:
        self._arena = (address, size)

    def recover(self) -> int:
        """Start connecting in the background; Mooncake keeps no index to rebuild."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._connect_loop, name="kv-mooncake", daemon=True
            )
            self._thread.start()
        return 0

    @property
    def connected(self) -> bool:
        return self._client is not None

    def _connect_loop(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            if self._reachable() and self._connect():
                return
            self._stop.wait(delay)
            delay = min(delay * 2, 2.0)

    def _reachable(self) -> bool:
        """A TCP probe first: the client's own set-up blocks for minutes on a dead master."""
        try:
            socket.create_connection((self.host, self.port), timeout=1.0).close()
            return True
        except OSError as exc:
            self.degraded = f"master {self.settings.master} unreachable: {exc.strerror or exc}"
            self._logs["unavailable"](logging.WARNING, "mooncake tier: %s; retrying", self.degraded)
            return False

    def _connect(self) -> bool:
        try:
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO lines: several per call
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            self.degraded = f"mooncake client not installed: {exc}"
            log.error("mooncake tier: %s (pip install mooncake-transfer-engine-non-cuda)", exc)
            self._stop.set()
            return False
        s = self.settings
        client = MooncakeDistributedStore()
        hostname = s.local_hostname or route_address(self.host, self.port)
        rc = client.setup(
            hostname,
            s.metadata,
            s.segment_size,
            s.local_buffer_size,
            s.protocol,
            s.device,
            s.master,
        )
        if rc != 0 or not self._register(client):
            self.degraded = f"client set-up failed (rc {rc})"
            self._logs["unavailable"](logging.WARNING, "mooncake tier: %s; retrying", self.degraded)
            _close(client)
            return False
        self._client = client
        self.stats.connects += 1
        self.degraded = None
        log.info(
            "mooncake tier: connected to %s as %s (%s, lending %d bytes)",
            s.master,
            hostname,
            s.protocol,
            s.segment_size,
        )
        return True

    def _register(self, client) -> bool:
        """Register the arena, the header blocks and the staging area, once per client."""
        self._headers = mmap.mmap(-1, BLOCKS * CHUNK * HEADER)
        self._staging = mmap.mmap(-1, STAGING)
        regions = [
            (_mapped_address(self._headers), len(self._headers)),
            (_mapped_address(self._staging), len(self._staging)),
        ]
        if self._arena is not None:
            regions.append(self._arena)
        for addr, size in regions:
            if client.register_buffer(addr, size) != 0:
                log.error("mooncake tier: cannot register %d bytes at %#x", size, addr)
                return False
        base = regions[0][0]
        for i in range(BLOCKS):
            self._blocks.put(base + i * CHUNK * HEADER)
        return True

    def close(self) -> None:
        self._stop.set()
        client, self._client = self._client, None
        if client is not None:
            _close(client)

    # -- index ------------------------------------------------------------------------
    def _key(self, identity: str, key: str) -> str:
        return f"kvs/{identity}/{key}"

    def contains(self, identity: str, key: str) -> bool:
        return key in self.known.get(identity, ())

    def count(self, identity: str) -> int:
        return len(self.known.get(identity, ()))

    def held_keys(self, identity: str) -> list:
        return list(self.known.get(identity, ()))

    def _remember(self, identity: str, key: str) -> None:
        keys = self.known.get(identity)
        if keys is None:
            with self._known_lock:
                keys = self.known.setdefault(identity, set())
        if key not in keys:
            keys.add(key)
            self.changed(identity, [key], True)

    def _forget(self, identity: str, key: str) -> None:
        keys = self.known.get(identity, set())
        if key in keys:
            keys.discard(key)
            self.changed(identity, [key], False)

    def lookup(self, identity: str, keys: list[str]) -> list[bool]:
        """One `batch_is_exist` for all keys; an error is a miss."""
        client = self._client
        if client is None or not keys:
            if keys:
                self._unavailable(len(keys), "exists")
            return [False] * len(keys)
        codes = self._call(client.batch_is_exist, len(keys), [self._key(identity, k) for k in keys])
        if any(c < 0 for c in codes):
            self._unavailable(sum(c < 0 for c in codes), "exists")
        else:
            self.degraded = None
        found = [c == 1 for c in codes]
        for k, hit in zip(keys, found, strict=True):
            if hit:
                self._remember(identity, k)
        return found

    # -- moves (writer threads, copy executor) ----------------------------------------
    def write_batch(self, jobs: list[tuple[str, str, Any]]) -> list[bool]:
        """Chunks of at most CHUNK pages whose staged copies fit the staging area."""
        out: list[bool] = []
        chunk: list = []
        staged = 0
        for job in jobs:
            size = len(job[2]) if _address(job[2]) is None else 0
            if size > STAGING:
                out += self._write_chunk(chunk) + [self._written(job, -1)]
                chunk, staged = [], 0
                continue
            if len(chunk) == CHUNK or staged + size > STAGING:
                out += self._write_chunk(chunk)
                chunk, staged = [], 0
            chunk.append(job)
            staged += size
        return out + self._write_chunk(chunk)

    def _write_chunk(self, jobs: list) -> list[bool]:
        client = self._client
        if not jobs:
            return []
        if client is None:
            self._unavailable(len(jobs), "write")
            return [False] * len(jobs)
        block = self._blocks.get()
        try:
            with _Staged(self, jobs) as addrs:
                keys, ptrs, sizes = [], [], []
                for j, ((identity, key, page), addr) in enumerate(zip(jobs, addrs, strict=True)):
                    mkey = self._key(identity, key)
                    ctypes.memmove(block + j * HEADER, pagefile.encode_header(mkey, page), HEADER)
                    keys.append(mkey)
                    ptrs.append([block + j * HEADER, addr])
                    sizes.append([HEADER, len(page)])
                with self._put_lock:  # one batch in flight; the other writer hashes the next
                    codes = self._call(
                        client.batch_put_from_multi_buffers, len(keys), keys, ptrs, sizes
                    )
        finally:
            self._blocks.put(block)
        return [self._written(job, code) for job, code in zip(jobs, codes, strict=True)]

    def _written(self, job: tuple, code: int) -> bool:
        identity, key, page = job
        if code in (0, OBJECT_ALREADY_EXISTS):
            self.degraded = None
            self._remember(identity, key)
            self.stats.pages_written += 1
            self.stats.bytes_written += len(page)
            return True
        if code == NO_AVAILABLE_HANDLE:
            self.stats.no_space += 1
            self._logs["write"](
                logging.WARNING, "mooncake tier: no space in the cluster's segments"
            )
        elif code == RPC_FAIL:
            self._unavailable(1, "write")
        else:
            self.stats.write_errors += 1
            self._logs["write"](logging.WARNING, "mooncake tier: write failed, code %d", code)
        return False

    def read_batch(self, identity: str, items: list[tuple[str, memoryview]]) -> list[bool]:
        out: list[bool] = []
        for i in range(0, len(items), CHUNK):
            out += self._read_chunk(identity, items[i : i + CHUNK])
        return out

    def read(self, identity: str, key: str, dst: memoryview) -> bool:
        return self.read_batch(identity, [(key, dst)])[0]

    def _read_chunk(self, identity: str, items: list) -> list[bool]:
        client = self._client
        if client is None:
            self._unavailable(len(items), "read")
            return [False] * len(items)
        keys = [self._key(identity, k) for k, _ in items]
        block = self._blocks.get()
        try:
            ptrs = [[block + j * HEADER, _address(dst)] for j, (_, dst) in enumerate(items)]
            sizes = [[HEADER, len(dst)] for _, dst in items]
            codes = self._call(client.batch_get_into_multi_buffers, len(keys), keys, ptrs, sizes)
            heads = [ctypes.string_at(block + j * HEADER, HEADER) for j in range(len(items))]
        finally:
            self._blocks.put(block)
        return [
            self._verify(identity, item, mkey, head, code)
            for item, mkey, head, code in zip(items, keys, heads, codes, strict=True)
        ]

    def _verify(self, identity: str, item: tuple, mkey: str, head: bytes, code: int) -> bool:
        key, dst = item
        if code < 0:
            self._read_failed(identity, key, code)
            return False
        offset, digest = pagefile.parse_header(head, mkey, len(dst))
        if code != HEADER + len(dst) or offset != HEADER or xxhash.xxh3_64_intdigest(dst) != digest:
            self.stats.corrupt += 1
            self._forget(identity, key)
            self._logs["corrupt"](
                logging.WARNING, "mooncake tier: %s is not a valid page; removed", mkey
            )
            self._remove([mkey])
            return False
        self._remember(identity, key)
        self.stats.pages_read += 1
        self.stats.bytes_read += len(dst)
        return True

    def _read_failed(self, identity: str, key: str, code: int) -> None:
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_GONE):
            self.stats.evicted += 1
            self._forget(identity, key)
        elif code == LEASE_EXPIRED:
            self.stats.lease_expired += 1
        elif code == RPC_FAIL:
            self._unavailable(1, "read")
        elif code == INVALID_PARAMS:  # an object of another size under this key
            self.stats.corrupt += 1
        else:
            self.stats.read_errors += 1
        if code != RPC_FAIL:
            self._logs["read"](logging.INFO, "mooncake tier: read missed, code %d", code)

    def delete(self, identity: str, keys: list[str]) -> int:
        for k in keys:
            self._forget(identity, k)
        return sum(c == 0 for c in self._remove([self._key(identity, k) for k in keys]))

    def drop(self, identity: str) -> None:
        """Remove the pages of one identity that this process knows of (other nodes' pages
        of the same identity stay, until Mooncake evicts them)."""
        self.delete(identity, list(self.known.get(identity, ())))
        self.known.pop(identity, None)

    def _remove(self, mkeys: list[str]) -> list[int]:
        client = self._client
        if client is None or not mkeys:
            return []
        return self._call(client.batch_remove, len(mkeys), mkeys, True)

    def _call(self, fn, n: int, *args) -> list[int]:
        """A client call whose every result is an int code; an exception is n failures."""
        try:
            codes = fn(*args)
            if len(codes) == n:
                return codes
            raise ValueError(f"{len(codes)} results for {n} keys")
        except Exception as exc:  # never out of a tier: a miss, counted
            self.stats.read_errors += 1
            self._logs["read"](logging.ERROR, "mooncake tier: %s failed: %s", fn.__name__, exc)
            return [-1] * n

    # -- observation ------------------------------------------------------------------
    def _unavailable(self, n: int, what: str) -> None:
        self.stats.unavailable += n
        if self._client is not None:
            self.degraded = f"master {self.settings.master} unavailable"
        self._logs["unavailable"](
            logging.WARNING,
            "mooncake tier: %s failed, master %s "
            "unavailable (a miss; serving from the other tiers)",
            what,
            self.settings.master,
        )

    def describe(self) -> dict:
        s = self.settings
        return {
            "master": s.master,
            "metadata": s.metadata,
            "protocol": s.protocol,
            "segment_size": s.segment_size,
            "connected": self.connected,
            "pages": sum(map(len, list(self.known.values()))),
            "shared": True,
            "degraded": self.degraded,
            **asdict(self.stats),
        }


class _Staged:
    """Addresses of the pages of a write: an arena slot as it is; a read-only staged copy
    (write-back) goes through the registered staging area, under a lock."""

    def __init__(self, tier: MooncakeTier, jobs: list):
        self.tier, self.jobs, self.locked = tier, jobs, False

    def __enter__(self) -> list[int]:
        found = [_address(page) for _, _, page in self.jobs]
        if all(a is not None for a in found):
            return [a for a in found if a is not None]
        staging = self.tier._staging  # write_batch keeps a chunk's copies within it
        assert staging is not None, "registered before any write"
        self.tier._staging_lock.acquire()
        self.locked = True
        base, at, addrs = _mapped_address(staging), 0, []
        for (_, _, page), a in zip(self.jobs, found, strict=True):
            if a is None:
                staging[at : at + len(page)] = page
                a = base + at
                at += len(page)
            addrs.append(a)
        return addrs

    def __exit__(self, *exc) -> None:
        if self.locked:
            self.tier._staging_lock.release()


def _close(client) -> None:
    with contextlib.suppress(Exception):  # a client that never set up may refuse to close
        client.close()
