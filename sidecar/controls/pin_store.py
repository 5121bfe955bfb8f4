"""The pin store on disk: each namespace's operators' pins, kept in the data dir across a
restart (read back by `sidecar.controls.keeper.Keeper`).

    <data dir>/pins/<digest of the record's scope>.pins        0600, in a 0700 directory

    offset 0       8              16
    +--------------+--------------+---------------------------------------------------+
    | magic        | xxh3(scope   | JSON: {"identity", "ref", "pins": [[key, expiry   |
    | KVSPINS\\x01  |  + body)     |        as wall-clock seconds], ...]} (the body)   |
    +--------------+--------------+---------------------------------------------------+

A record belongs to one namespace: its scope is the namespace's tier identity (spec, name
and `owner_tag`: uid, share group, operator or anonymous TCP) and its ref (name@uid). The
scope names the file and keys its checksum, so a namespace reads only a record written for
its own scope: another owner's namespace of the same name (a uid's, or anonymous TCP's on a
sidecar restarted without its token) never gets its pins, and a renamed, planted, torn or
damaged file is ignored, removed, logged and counted (`damaged`); start-up never reads one.

Written as the file tier writes a page: a unique temporary name (`pagefile.temp_name`),
fsync, rename, fsync of the directory; a record with no pin left is removed. Writes run on
lane threads (sidecar/lanes.py: one at a time an owner), never on the event loop, and are
coalesced: one write in flight a record; changes meanwhile mark it dirty and one more write
then takes the state of that moment. A restore holds its record (`load` ... `release`) so
no write replaces it before it is read. The first job sweeps the directory: abandoned
temporaries, records older than TTL_MAX (every pin in them has expired), and the oldest
past MAX_FILES go.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import orjson
import xxhash

from sidecar.keys import check_key
from sidecar.lanes import Job, Lanes
from sidecar.tiers import pagefile

log = logging.getLogger("kv_sidecar.pins")
MAGIC = b"KVSPINS\x01"
HEAD = struct.Struct("<8sQ")
SUFFIX = ".pins"
PERSIST_MAX = 65536  # pins a record keeps (a namespace's oldest); the rest live in memory only
MAX_BYTES = HEAD.size + 64 + PERSIST_MAX * 160  # a key is at most 128 characters
MAX_FILES = 4096  # records kept (`tenancy.MAX_NAMESPACES`); the oldest past it go
MAX_AGE = 7 * 86400.0  # selection.TTL_MAX: a record older holds only expired pins
THREADS = 2

Pins = list[tuple[str, float]]  # (key, expiry in wall-clock seconds), oldest pin first


def scope(identity: str, ref: str) -> bytes:
    """Whose record it is: the namespace's tier identity (spec and owner) and its ref."""
    return f"{identity}\n{ref}".encode()


def encode(identity: str, ref: str, pins: Pins) -> bytes:
    body = orjson.dumps({"identity": identity, "ref": ref, "pins": pins})
    return HEAD.pack(MAGIC, xxhash.xxh3_64_intdigest(scope(identity, ref) + body)) + body


def decode(raw: bytes, identity: str, ref: str) -> Pins | None:
    """The pins of a record written for (identity, ref), None when it is not one."""
    if len(raw) < HEAD.size or len(raw) > MAX_BYTES:
        return None
    magic, digest = HEAD.unpack_from(raw)
    body = raw[HEAD.size :]
    if magic != MAGIC or digest != xxhash.xxh3_64_intdigest(scope(identity, ref) + body):
        return None
    try:
        pins = orjson.loads(body)["pins"]
        out = [(check_key(k), float(t)) for k, t in pins]
    except Exception:  # any shape but the one written: not a record
        return None
    return out if len(out) <= PERSIST_MAX else None


@dataclass(slots=True, eq=False)
class _Record:
    identity: str
    ref: str
    owner: Hashable
    source: Callable[[], Pins] = list
    dirty: bool = False
    held: int = 0  # restores reading or applying it: no write starts
    task: asyncio.Task | None = None
    waiters: list[asyncio.Future] = field(default_factory=list)


class PinStore:
    """Every namespace's pin record under `root` (the event loop's side: state lives here,
    files are touched on lane threads only)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.lanes = Lanes("kv-pins", THREADS, 1)
        self.records: dict[str, _Record] = {}  # file name -> record in use
        self.closed = False
        self.written = 0
        self.write_errors = 0
        self.damaged = 0
        self._swept = False
        self._lock = threading.Lock()

    def _name(self, identity: str, ref: str) -> str:
        return hashlib.sha256(scope(identity, ref)).hexdigest()[:32] + SUFFIX

    def _record(self, identity: str, ref: str, owner: Hashable) -> _Record:
        name = self._name(identity, ref)
        rec = self.records.get(name)
        if rec is None:
            rec = self.records[name] = _Record(identity, ref, owner)
        return rec

    # -- on the loop -----------------------------------------------------------------
    async def load(self, identity: str, ref: str, owner: Hashable) -> Pins:
        """Hold the record (writes wait until `release`) and read it once no write of it
        is in flight: its pins, [] when there is none or it is damaged."""
        rec = self._record(identity, ref, owner)
        rec.held += 1
        while rec.task is not None:
            await asyncio.shield(rec.task)
        path = os.path.join(self.root, self._name(identity, ref))
        job = await self._run(owner, lambda: self._read(path, identity, ref))
        if job.error is not None:
            log.error("pins of %s: cannot read %s: %s", ref, path, job.error)
            return []
        return job.result

    def release(self, identity: str, ref: str, source: Callable[[], Pins], dirty: bool) -> None:
        """A restore ended: writes of the record may go (one now when `dirty`)."""
        rec = self.records[self._name(identity, ref)]
        rec.held -= 1
        rec.source = source
        rec.dirty |= dirty
        self._kick(rec)

    def changed(
        self, identity: str, ref: str, owner: Hashable, source: Callable[[], Pins]
    ) -> asyncio.Future:
        """The pins of (identity, ref) changed: `source()` gives them (on the loop). The
        future answers True once a write that began after this call kept them."""
        fut = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_result(False)
            return fut
        rec = self._record(identity, ref, owner)
        rec.source, rec.dirty = source, True
        rec.waiters.append(fut)
        self._kick(rec)
        return fut

    def _kick(self, rec: _Record) -> None:
        if rec.task is None and not rec.held and not self.closed:
            if rec.dirty:
                rec.task = asyncio.get_running_loop().create_task(self._write_loop(rec))
            elif not rec.waiters:
                self.records.pop(self._name(rec.identity, rec.ref), None)

    async def _write_loop(self, rec: _Record) -> None:
        try:
            while rec.dirty and not rec.held and not self.closed:
                rec.dirty = False
                waiters, rec.waiters, ok = rec.waiters, [], False
                try:
                    path = os.path.join(self.root, self._name(rec.identity, rec.ref))
                    pins = rec.source()
                    write = functools.partial(self._write, path, rec.identity, rec.ref, pins)
                    job = await self._run(rec.owner, write)
                    ok = job.error is None
                    if ok:
                        self.written += 1
                    else:
                        self.write_errors += 1
                        log.error("pins of %s: cannot write %s: %s", rec.ref, path, job.error)
                finally:
                    _answer(waiters, ok)
        finally:
            rec.task = None
            if self.closed:
                _answer(rec.waiters, False)
            else:
                self._kick(rec)

    async def _run(self, owner: Hashable, fn: Callable[[], object]) -> Job:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()

        def done(job: Job) -> None:
            if not fut.done():
                fut.set_result(job)

        self.lanes.submit(owner, fn, done)
        return await fut

    async def close(self, timeout: float) -> None:
        """Let the writes in flight and those due end (at most `timeout` s), then write no
        more: the namespaces a shutdown drops keep their records."""
        tasks = [r.task for r in self.records.values() if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        self.closed = True
        for rec in self.records.values():  # (held by a restore: never written now)
            _answer(rec.waiters, False)
        self.lanes.close()

    # -- on lane threads -------------------------------------------------------------
    def _read(self, path: str, identity: str, ref: str) -> Pins:
        self._sweep()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return []
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            pins = None  # a link where a record goes: not one of ours
        else:
            try:
                st = os.fstat(fd)
                ok = stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES
                pins = decode(os.pread(fd, MAX_BYTES + 1, 0), identity, ref) if ok else None
            finally:
                os.close(fd)
        if pins is None:
            with self._lock:
                self.damaged += 1
            log.warning("pins of %s: %s is damaged or not this namespace's; ignored", ref, path)
            pagefile._unlink(path)
            return []
        return pins

    def _write(self, path: str, identity: str, ref: str, pins: Pins) -> None:
        """Publish the record of `pins` at `path` (none: remove it), durable once this
        returns."""
        self._sweep()
        if not pins:
            if pagefile.remove(path):
                pagefile.fsync_dir(self.root)
            return
        self._make_dir()
        pagefile.publish(self.root, os.path.basename(path), encode(identity, ref, pins), 0o600)

    def _make_dir(self) -> None:
        """The records' directory, 0700; one already there must be a real directory."""
        try:
            os.mkdir(self.root, 0o700)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(self.root).st_mode):
                raise OSError(errno.ENOTDIR, f"{self.root} is a link or not a directory") from None

    def _sweep(self) -> None:
        """Once: abandoned temporaries, records older than MAX_AGE, the oldest past
        MAX_FILES."""
        with self._lock:
            if self._swept:
                return
            self._swept = True
        now, records = time.time(), []
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(self.root, name))
                if not stat.S_ISREG(st.st_mode):
                    continue
                if name.endswith(SUFFIX) and now - st.st_mtime <= MAX_AGE:
                    records.append((st.st_mtime, name))
                elif name.endswith(SUFFIX) or pagefile.abandoned(name, st.st_mtime, now):
                    pagefile._unlink(os.path.join(self.root, name))
        records.sort()
        for _, name in records[: max(len(records) - MAX_FILES, 0)]:
            pagefile._unlink(os.path.join(self.root, name))


def _answer(waiters: list[asyncio.Future], ok: bool) -> None:
    for w in waiters:
        if not w.done():
            w.set_result(ok)
