"""The 3FS tier: slotted page files and per-node index logs on a directory every node mounts.

    <root>/nodes/<node>/lock              held (flock) by the live sidecar of that name
    <root>/nodes/<node>/log.<gen>         its index records, appended by it alone (hf3fs_log)
    <root>/nodes/<node>/snap.<gen>        its live pages when <gen> began (compaction)
    <root>/nodes/<node>/<file>.slot       64 pages of one length, preallocated (hf3fs_slots)

A node writes only under its own directory: a page goes into a slot of its own slot file,
the file is fdatasynced, then the PUT record is appended to its log and fsynced; only
then is the page in the index and the write acknowledged. Every node tails every other
node's log from its last offset (one pread a log a poll, `POLL` seconds apart) and applies
the records to its in-memory index (hf3fs_index: ~22 bytes a page): no rescan after start,
no per-key metadata call to find what another node wrote. A restart loads each node's last
snapshot and the log after it. Every read checks the slot's header and checksum: a torn,
damaged or stale slot is a miss. Why this and not the seeds' metadata server: docs/3fs.md.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import asdict

import xxhash

from sidecar.tiers import hf3fs_log as hlog
from sidecar.tiers import hf3fs_slots as slots
from sidecar.tiers import pagefile
from sidecar.tiers.base import RateLog, Tier, TierStats
from sidecar.tiers.hf3fs_index import (
    MAX_FILE,
    MAX_NODES,
    CompactIndex,
    IdentityTable,
    pack,
    page_hash,
    unpack,
)
from sidecar.tiers.hf3fs_load import Loader, OwnFile, Peer, snapshot

try:  # the 3FS native client (usrbio); POSIX I/O on the FUSE mount without it
    from hf3fs_fuse import io as usrbio
except ImportError:  # pragma: no cover - only on 3FS hosts
    usrbio = None

log = logging.getLogger("kv_sidecar.tiers")
POLL = 0.1  # seconds between reads of the other nodes' logs
NODE_SCAN = 1.0  # seconds between listings of <root>/nodes (new nodes; shrunk logs: 10x)
COMPACT_AT = 50_000  # records in this node's log before it writes a snapshot
ENOSPC_RETRIES = 2
READY_WAIT = 60.0  # a write before recovery ended waits this long, then fails


def node_name(home: str) -> str:
    """This sidecar's default node name: its host and a digest of its data dir."""
    host = "".join(c if c.isalnum() or c in ".-" else "-" for c in socket.gethostname())
    return f"{host[:60] or 'host'}-{xxhash.xxh3_64_hexdigest(os.path.abspath(home).encode())[:8]}"


class Hf3fsTier(Tier):
    """Pages on the 3FS mount `root`, this node's at most `capacity` bytes (None: no
    limit). `node` names this sidecar (default: host + data dir digest); a name another
    live sidecar holds gets a suffix. With `group` files are 0640 and directories 2770."""

    name = "hf3fs"
    shared = True

    def __init__(self, root: str, capacity: int | None = None, group: int | None = None,
                 node: str | None = None, poll: float = POLL):  # fmt: skip
        self.root = self.where = os.path.abspath(root)
        self.capacity, self.group, self.poll = capacity, group, poll
        self.file_mode, self.dir_mode = (0o600, 0o700) if group is None else (0o640, 0o2770)
        self.node_hint = node or node_name(self.root)
        self.compact_at = COMPACT_AT
        self.stats = TierStats()
        self.degraded: str | None = None
        self.table = CompactIndex()
        self.idents = IdentityTable()
        self.peers: list[Peer] = []  # [0]: this node
        self.by_tag: dict[int, int] = {}
        self.own: OrderedDict[int, OwnFile] = OrderedDict()  # least recently used first
        self.filling: dict[int, OwnFile] = {}  # page length -> the file being filled
        self.next_file = 0
        self.used = 0  # bytes of this node's slot files
        self.discovery = {"polls": 0, "log_reads": 0, "records": 0, "node_scans": 0}
        self.damaged = 0  # log records skipped as damaged or forged
        self.log: hlog.LogWriter | None = None
        self.fds = slots.FdCache()
        self._lock = threading.Lock()  # index, identities, own files, peers
        self._alloc = threading.Lock()  # placing pages in slots (writer threads)
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._poll_lock = threading.Lock()
        self._next_scan = 0.0
        self._lock_fd = -1
        self._ratelog = RateLog()
        self._quiet = False  # loading: the listener hears nothing

    @property
    def node(self) -> str:
        return self.peers[0].name if self.peers else self.node_hint

    # -- index ------------------------------------------------------------------------
    def ident(self, identity: str) -> bytes | None:
        try:
            raw = bytes.fromhex(identity)
        except ValueError:
            return None
        return raw if len(raw) == 16 else None

    def contains(self, identity: str, key: str) -> bool:
        ident = self.ident(identity)
        return ident is not None and self.table.get(page_hash(ident, key)) is not None

    def count(self, identity: str) -> int:
        with self._lock:
            n = self.idents.find(identity)
            return 0 if n is None else self.idents.counts[n]

    def pages(self) -> int:
        return len(self.table)

    def held(self) -> int:
        """Bytes this node holds on the mount: its slot files and its log generations."""
        return self.used + (self.log.size() if self.log is not None else 0)

    # -- writes (tier writer threads) -------------------------------------------------
    def write_batch(self, jobs: list[tuple[str, str, memoryview]]) -> list[bool]:
        """Place each new page in a slot of this node's files, fdatasync those files, then
        append and fdatasync their PUT records: only then are they indexed and True. A page
        the tier already holds (any node's copy) is True without a write."""
        ok = [False] * len(jobs)
        if not self._ready.wait(READY_WAIT) or self.log is None:
            self._failed("write", OSError(errno.EAGAIN, "the tier is not recovered"))
            return ok
        todo, seen = [], set()
        for i, (identity, key, page) in enumerate(jobs):
            ident = self.ident(identity)
            if ident is None or not hlog.KEY_OK.fullmatch(key.encode()):
                self._failed("write", OSError(errno.EINVAL, f"not a 3FS page name: {key!r}"))
                continue
            h = page_hash(ident, key)
            if h in seen or self.table.get(h) is not None:
                ok[i] = True
                continue
            seen.add(h)
            todo.append((i, ident, key, memoryview(page).cast("B"), h))
        while todo:  # a batch that fills the cap commits, then evicts its own files
            placed, todo = self._place(todo)
            try:
                for i in self._publish(self._sync(placed)):
                    ok[i] = True
            finally:
                with self._lock:
                    for _i, _ident, _key, _h, f, _s, _n in placed:
                        f.busy -= 1
                self._reap([f for *_, f, _s, _n in placed])
        if self.log.records > self.compact_at:
            self.compact()
        return ok

    def _place(self, todo: list) -> tuple[list, list]:
        """Write pages into fresh slots (not synced): (i, ident, key, h, file, slot, length)
        of those written, each holding its file busy, and the pages not tried because the
        cap is held by this batch's own files (commit those placed, then go on)."""
        placed: list = []
        for n, (i, ident, key, view, h) in enumerate(todo):
            for attempt in range(ENOSPC_RETRIES + 1):
                try:
                    f, s = self._slot(len(view))
                except OSError as exc:
                    if attempt < ENOSPC_RETRIES and hlog.no_space(exc) and self._evict_one():
                        continue
                    if hlog.no_space(exc) and placed:
                        return placed, todo[n:]
                    self._failed("write", exc)
                    break
                try:
                    slots.write(f.fd, s, ident, key, view)
                except OSError as exc:
                    with self._lock:
                        f.busy -= 1
                    if attempt < ENOSPC_RETRIES and hlog.no_space(exc) and self._evict_one():
                        continue
                    self._failed("write", exc)
                    break
                placed.append((i, ident, key, h, f, s, len(view)))
                break
        return placed, []

    def _slot(self, length: int) -> tuple[OwnFile, int]:
        """The next free slot for a page of `length` (a new file when none), held busy."""
        with self._alloc:
            f = self.filling.get(length)
            if f is None or f.full:
                f = self._new_file(length)
            with self._lock:
                s, f.next = f.next, f.next + 1
                f.busy += 1
                if f.full:
                    self.filling.pop(length, None)
                self.own.move_to_end(f.number)
            return f, s

    def _new_file(self, length: int) -> OwnFile:
        """A new preallocated slot file, within this node's capacity (evicting its least
        recently used files). Under `_alloc`."""
        count = slots.per_file(length, self.capacity)
        size = count * slots.stride(length)
        if self.capacity is not None and size > self.capacity:
            raise OSError(errno.EFBIG, f"a page of {length} bytes exceeds the 3FS size")
        while self.capacity is not None and self.held() + size > self.capacity:
            if not self._evict_one():
                raise OSError(errno.ENOSPC, "this node's 3FS size is held by writes in flight")
        number = self.next_file
        if number > MAX_FILE:
            raise OSError(errno.EMFILE, "slot file numbers are used up")
        fd = slots.create(self.peers[0].dir, number, length, count, self.file_mode)
        f = OwnFile(number, length, count, fd)
        with self._lock:
            self.next_file = number + 1
            self.own[number] = f
            self.filling[length] = f
            self.used += size
        return f

    def _sync(self, placed: list) -> list:
        """fdatasync each file written once; the placed pages whose file synced."""
        bad = set()
        for f in {id(p[4]): p[4] for p in placed}.values():
            try:
                os.fdatasync(f.fd)
            except OSError as exc:
                self._failed("fsync", exc)
                bad.add(id(f))
        return [p for p in placed if id(p[4]) not in bad]

    def _publish(self, synced: list) -> list[int]:
        """Append and fdatasync the PUT records, then index the pages; their job indexes."""
        if not synced:
            return []
        assert self.log is not None
        tag = self.peers[0].tag
        blob = b"".join(
            hlog.encode(hlog.Record(hlog.PUT, h, tag, ident, f.number, s, n, 0, key))
            for _i, ident, key, h, f, s, n in synced
        )
        told = []
        with self.log.lock:
            try:
                self.log._append(blob)
            except OSError as exc:
                self._failed("publish", exc)
                return []
            with self._lock:
                for _i, ident, key, h, f, s, n in synced:
                    no = self.idents.number(ident)
                    if no is None:
                        continue
                    f.hashes[s], f.idents[s], f.live = h, no, f.live + 1
                    if self.table.put(h, pack(no, 0, f.number, s)) is None:
                        self.idents.counts[no] += 1
                        told.append((ident.hex(), key))
                    self.stats.pages_written += 1
                    self.stats.bytes_written += n
        for identity, key in told:
            self.changed(identity, [key], True)
        return [p[0] for p in synced]

    # -- eviction and deletes ------------------------------------------------------------
    def _evict_one(self) -> bool:
        """Evict this node's least recently used slot file that no write holds: log a DEL
        for each of its pages, then remove it. False when none can go."""
        with self._lock:
            victim = next((f for f in self.own.values() if not f.busy), None)
            if victim is None:
                return False
            self.own.pop(victim.number)
            if self.filling.get(victim.length) is victim:
                del self.filling[victim.length]
        gone = self._forget_own(victim, [s for s in range(slots.SLOTS) if victim.hashes[s]])
        if gone is None:
            with self._lock:
                self.own[victim.number] = victim
                self.own.move_to_end(victim.number, last=False)
            return False
        self.stats.evictions += gone
        self._remove_file(victim)
        return True

    def _forget_own(self, f: OwnFile, which: list[int]) -> int | None:
        """Log DELs for slots `which` of own file `f` and unindex them; None: not logged."""
        if not which:
            return 0
        assert self.log is not None
        tag = self.peers[0].tag
        path = self._path(0, f.number)
        recs, told = [], []
        fd = f.fd if f.fd >= 0 else self._open_quiet(path)
        for s in which:
            named = slots.read_key(fd, s, f.length) if fd >= 0 else None
            key = named[1] if named else ""
            ident = self.idents.raw[f.idents[s]]
            recs.append(hlog.Record(hlog.DEL, f.hashes[s], tag, ident, f.number, s, 0, 0, key))
        if fd >= 0 and fd != f.fd:
            os.close(fd)
        with self.log.lock:
            try:
                self.log._append(b"".join(map(hlog.encode, recs)))
            except OSError as exc:
                self._failed("delete", exc)
                return None
            with self._lock:
                for r in recs:
                    no = f.idents[r.slot]
                    if self.table.remove(r.h, pack(no, 0, f.number, r.slot)) is not None:
                        self.idents.counts[no] -= 1
                        told.append((r.ident.hex(), r.key))
                    if f.hashes[r.slot]:
                        f.hashes[r.slot], f.live = 0, f.live - 1
        for identity, key in told:
            if key:
                self.changed(identity, [key], False)
        return len(recs)

    def _remove_file(self, f: OwnFile) -> None:
        path = self._path(0, f.number)
        with self._lock:
            self.own.pop(f.number, None)
            self.used -= f.size
        self.fds.forget(path)
        if f.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(f.fd)
            f.fd = -1
        pagefile._unlink(path)

    def _reap(self, files: list[OwnFile]) -> None:
        """Remove own files that hold no page and take no more (full or freed)."""
        for f in {id(f): f for f in files}.values():
            with self._lock:
                done = not f.live and not f.busy and f.full
                done = done and self.own.get(f.number) is f
            if done:
                self._remove_file(f)

    def delete(self, identity: str, keys: list[str]) -> int:
        """Forget `keys`: one DEL record each, naming the copy this node's index holds (its
        owner, if another node, frees it when it reads the record). Logged, then unindexed:
        a delete that cannot be logged leaves the pages (`contains` still True)."""
        ident = self.ident(identity)
        if ident is None or self.log is None:
            return 0
        found: list[tuple[str, int, int]] = []
        with self._lock:
            for k in keys:
                h = page_hash(ident, k)
                w = self.table.get(h)
                if w is not None:
                    found.append((k, h, w))
        recs = []
        for key, h, where in found:
            _no, node, file, slot = unpack(where)
            tag = self.peers[node].tag
            recs.append(hlog.Record(hlog.DEL, h, tag, ident, file, slot, 0, 0, key))
        if not recs:
            return 0
        n, freed = 0, []
        with self.log.lock:
            try:
                self.log._append(b"".join(map(hlog.encode, recs)))
            except OSError as exc:
                self._failed("delete", exc)
                return 0
            with self._lock:
                for (_key, h, where), r in zip(found, recs, strict=True):
                    if self.table.remove(h, where) is not None:
                        n += 1
                        self.idents.counts[where >> 48] -= 1
                    if r.node == self.peers[0].tag:
                        freed.append(self._unslot(r.file, r.slot, h))
        self.changed(identity, [k for k, _h, _w in found], False)
        self._reap([f for f in freed if f is not None])
        return n

    def _unslot(self, file: int, slot: int, h: int) -> OwnFile | None:
        """Mark an own slot free (under the lock); its file, for `_reap`."""
        f = self.own.get(file)
        if f is None or f.hashes[slot] != h:
            return None
        f.hashes[slot], f.live = 0, f.live - 1
        return f

    def drop(self, identity: str) -> None:
        """Forget every page of one identity on every node: one DROP record; each owner
        frees its own slots of it when it reads the record (this node at once)."""
        ident = self.ident(identity)
        if ident is None or self.log is None:
            return
        with self.log.lock:
            try:
                self.log._append(hlog.encode(hlog.Record(hlog.DROP, 0, 0, ident, 0, 0, 0, 0, "")))
            except OSError as exc:
                self._failed("delete", exc)
                return
            with self._lock:
                mine = self._drop_locked(ident)
                for f, which in mine:
                    for s in which:
                        f.hashes[s], f.live = 0, f.live - 1
        self._reap([f for f, _ in mine])

    def _drop_locked(self, ident: bytes) -> list[tuple[OwnFile, list[int]]]:
        """Unindex every page of `ident` (under the lock: a walk of the whole index); this
        node's slots of it, (file, slots), for the caller to free."""
        no = self.idents.numbers.get(ident)
        if no is None:
            return []
        self.table.remove_where(lambda where: where >> 48 == no)
        self.idents.counts[no] = 0
        mine = []
        for f in self.own.values():
            which = [s for s in range(slots.SLOTS) if f.hashes[s] and f.idents[s] == no]
            if which:
                mine.append((f, which))
        return mine

    # -- reads (copy executor threads) ------------------------------------------------
    def read(self, identity: str, key: str, dst: memoryview) -> bool:
        """Fill `dst` with a verified page; a missing, torn, damaged or stale slot is a miss
        (and leaves the index)."""
        ident = self.ident(identity)
        if ident is None:
            return False
        h = page_hash(ident, key)
        where = self.table.get(h)
        if where is None:
            return False
        _no, node, file, slot = unpack(where)
        path = self._path(node, file)
        try:
            fd = self.fds.take(path)
        except FileNotFoundError:
            self._unindex(h, where)
            return False
        except OSError as exc:
            self._failed("read", exc)
            return False
        try:
            good = slots.read(fd, slot, ident, key, dst)
        except OSError as exc:
            self._failed("read", exc)
            return False
        finally:
            self.fds.give(path, fd)
        if not good:
            self.stats.corrupt += 1
            self._ratelog(logging.WARNING, "3FS slot %s/%d is torn, damaged or stale", path, slot)
            self._unindex(h, where)
            return False
        with self._lock:
            if node == 0 and file in self.own:
                self.own.move_to_end(file)
            self.stats.pages_read += 1
            self.stats.bytes_read += len(dst)
        return True

    def _unindex(self, h: int, where: int) -> None:
        with self._lock:
            if self.table.remove(h, where) is not None:
                self.idents.counts[where >> 48] -= 1

    # -- other nodes: the poller --------------------------------------------------------
    def poll_once(self) -> int:
        """Read every other node's log past its offset, apply what is new; every NODE_SCAN
        seconds also list the nodes (a new node) and reload broken ones. Records applied."""
        with self._poll_lock:
            now = time.monotonic()
            if now >= self._next_scan:
                self._next_scan = now + NODE_SCAN
                self.loader.scan_nodes()
            self.discovery["polls"] += 1
            n = 0
            for no in range(1, len(self.peers)):
                n += self.loader.drain(no)
            self.loader.settle()
            return n

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.poll_once()
            except Exception:  # never let the poller die: the next poll tries again
                log.exception("3FS tier: reading the other nodes' logs failed")

    # -- recovery ---------------------------------------------------------------------
    def recover(self) -> int:
        """At start: claim this node's directory, load every node's snapshot and log, start
        the poller. Later calls (the sidecar's rescans) are one poll: no rescan."""
        if self._ready.is_set():
            return self.poll_once()
        self.loader = Loader(self)
        try:
            pages = self.loader.start()
        except OSError:
            raise
        except Exception as exc:  # a bug must not hold the sidecar unready: degrade, say why
            log.exception("3FS tier: loading the nodes' logs failed")
            raise OSError(errno.EIO, f"loading the 3FS logs failed: {exc!r}") from exc
        if self.log is not None and self.log.records > self.compact_at:
            self.compact()
        self._ready.set()
        self._poller = threading.Thread(target=self._poll_loop, name="kv-3fs-tail", daemon=True)
        self._poller.start()
        return pages

    def compact(self) -> None:
        """Write this node's live pages as snap.<gen+1> and go on at log.<gen+1>: a restart
        then reads the snapshot and a short log, never the whole history."""
        assert self.log is not None
        with self.log.lock:  # (own slots change only under it: the snapshot is exact)
            snap = snapshot(self, self.log.gen + 1)
            try:
                self.log.switch(snap, self.log.gen + 1)
            except OSError as exc:
                self._failed("compact", exc)

    # -- helpers ------------------------------------------------------------------------
    def _path(self, node: int, file: int) -> str:
        return os.path.join(self.peers[node].dir, slots.file_name(file))

    @staticmethod
    def _open_quiet(path: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return -1

    def _failed(self, what: str, exc: OSError) -> None:
        with self._lock:
            self.stats.failed(what)
            self.degraded = f"{what}: {exc.strerror or exc}"
        self._ratelog(logging.ERROR, "3FS tier %s failed: %s (a miss)", what, exc)

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(5)
        with self._lock:
            for f in self.own.values():
                if f.fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(f.fd)
                    f.fd = -1
            for p in self.peers[1:]:
                if p.tail is not None:
                    p.tail.close()
        if self.log is not None:
            self.log.close()
        self.fds.close()
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def describe(self) -> dict:
        return {
            "root": self.root,
            "node": self.node,
            "nodes": len(self.peers),
            "pages": len(self.table),
            "own_pages": sum(f.live for f in list(self.own.values())),
            "bytes": self.held(),
            "capacity": self.capacity,
            "shared": True,
            "usrbio": usrbio is not None,
            "degraded": self.degraded,
            "damaged_records": self.damaged,
            **self.discovery,
            **asdict(self.stats),
        }


__all__ = ["MAX_NODES", "Hf3fsTier", "OwnFile", "Peer", "node_name"]
