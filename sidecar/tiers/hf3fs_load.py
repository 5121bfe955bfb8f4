"""Loading and tailing the nodes' logs into the 3FS tier's index (hf3fs_tier.Hf3fsTier).

At start: claim this node's directory, number every node listed under <root>/nodes, load
this node's snapshot and log (its own slot files follow from them; the log's torn tail
is cut), then every other node's, and keep a `Tail` on each at the end. Afterwards the
tier's poller calls `drain` for each node (one pread when nothing is new) and, every
NODE_SCAN seconds, `scan_nodes` (one listing: a new node; a log that shrank or failed is
reloaded). A record is applied only when it checks: its checksum (hf3fs_log.parse), its
page hash against its identity and key, its node tag against the log it is in.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import time
from array import array
from typing import Any

import xxhash

from sidecar.tiers import hf3fs_log as hlog
from sidecar.tiers import hf3fs_slots as slots
from sidecar.tiers import pagefile
from sidecar.tiers.hf3fs_index import MAX_FILE, MAX_NODES, low, pack, page_hash

log = logging.getLogger("kv_sidecar.tiers")
_ENTRY = struct.Struct("<QQ")
EMPTY: tuple[list, list, bytes] = ([], [], b"")
Hf3fsTier = Any  # sidecar.tiers.hf3fs_tier.Hf3fsTier, not imported: no import circle
_xxh3 = xxhash.xxh3_64_intdigest  # (hf3fs_index.page_hash, inlined in the poll's loop)
SHRINK_EVERY = 10  # node listings between checks that no log shrank (a lost tail)


class OwnFile:
    """One of this node's slot files: which slot holds which page (hash 0: none)."""

    __slots__ = ("number", "length", "count", "fd", "hashes", "idents", "next", "live", "busy")

    def __init__(self, number: int, length: int, count: int = slots.SLOTS, fd: int = -1):
        self.number, self.length, self.count, self.fd = number, length, count, fd
        self.hashes = array("Q", bytes(8 * slots.SLOTS))
        self.idents = array("H", bytes(2 * slots.SLOTS))
        self.next = count if fd < 0 else 0  # the next slot to fill (a loaded file: none)
        self.live = 0
        self.busy = 0  # writes placed, not yet published or failed

    @property
    def full(self) -> bool:
        return self.next >= self.count

    @property
    def size(self) -> int:
        return self.count * slots.stride(self.length)


class Peer:
    """A node this process knows: its name, tag, directory and (others) the log it tails."""

    __slots__ = ("name", "tag", "dir", "tail", "broken")

    def __init__(self, name: str, directory: str):
        self.name, self.tag, self.dir = name, hlog.node_tag(name), directory
        self.tail: hlog.Tail | None = None
        self.broken = False


class Loader:
    def __init__(self, tier: Hf3fsTier):
        self.t = tier
        self.told: list[tuple[bytes, str, bool]] = []  # for the listener, in order
        self.frees: list[tuple[int, int, int]] = []  # own (file, slot, hash) others deleted
        self.drops: list[bytes] = []  # identities other nodes dropped
        self.scans = 0

    def start(self) -> int:
        t = self.t
        me = claim(t)
        t.peers, t.by_tag = [me], {me.tag: 0}
        for name in self._list():
            if name != me.name:
                self._number(Peer(name, os.path.join(t.root, "nodes", name)))
        t._quiet = True
        gen, end = self._load(0)
        if me.tail is not None:
            me.tail.close()
            me.tail = None
        t.log = hlog.LogWriter(me.dir, gen, t.file_mode, end)
        for no in range(1, len(t.peers)):
            self._load(no)
        self._tidy_own()
        self.told.clear()  # a start tells the listener nothing (as the file tier)
        t._quiet = False
        self.settle()
        return len(t.table)

    # -- nodes ------------------------------------------------------------------------
    def _list(self) -> list[str]:
        """The node directories (real directories only: never a link someone planted)."""
        self.t.discovery["node_scans"] += 1
        with os.scandir(os.path.join(self.t.root, "nodes")) as it:
            names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
        return sorted(n for n in names if hlog.NODE_NAME.fullmatch(n))

    def _number(self, peer) -> int | None:
        t = self.t
        if len(t.peers) >= MAX_NODES:
            log.warning("3FS tier: more than %d nodes; %s is not read", MAX_NODES, peer.name)
            return None
        with t._lock:
            t.peers.append(peer)
            t.by_tag.setdefault(peer.tag, len(t.peers) - 1)
        return len(t.peers) - 1

    def scan_nodes(self) -> None:
        """List the nodes: load a new one, retry one without a log yet, reload one whose
        log shrank or failed (its pages leave the index first)."""
        t = self.t
        self.scans += 1
        check = self.scans % SHRINK_EVERY == 0  # an fstat a log every SHRINK_EVERY scans
        known = {p.name for p in t.peers}
        for name in self._list():
            if name not in known:
                no = self._number(Peer(name, os.path.join(t.root, "nodes", name)))
                if no is not None:
                    self._load(no)
        for no in range(1, len(t.peers)):
            p = t.peers[no]
            if p.tail is None:
                self._load(no)
            elif p.broken or (check and p.tail.shrank()):
                log.warning("3FS tier: node %s's log shrank or failed; reloading it", p.name)
                with t._lock:
                    gone = t.table.remove_where(_of_node(no))
                    for _h, where in gone:
                        t.idents.counts[where >> 48] -= 1
                p.tail.close()
                p.tail, p.broken = None, False
                self._load(no)
        self.settle()

    # -- loading ------------------------------------------------------------------------
    def _load(self, no: int) -> tuple[int, int]:
        """Load node `no`'s last good snapshot and the log after it; (gen, end offset)."""
        t, p = self.t, self.t.peers[no]
        try:
            logs, _snaps = hlog.generations(os.listdir(p.dir))
        except OSError:
            logs = []
        if not logs:
            return 0, 0  # a node that has not begun its log (this one: its first append)
        start = logs[-1]
        base = self._snapshot(p.dir, start)
        if base is None and start - 1 in logs:
            start -= 1
            base = self._snapshot(p.dir, start)
        if base is None:
            t.damaged += 1
            log.warning("3FS tier: node %s has no whole snapshot; older pages are misses", p.name)
            base, start = EMPTY, logs[-1]
        with t._lock:
            self._bulk(no, base)
        try:
            p.tail = hlog.Tail(p.dir, start)
        except OSError as exc:
            if no == 0:
                raise  # never go on appending to a log this node could not read
            log.warning("3FS tier: cannot read node %s's log: %s", p.name, exc)
            return start, 0
        self.drain(no)
        return p.tail.gen, p.tail.offset

    @staticmethod
    def _snapshot(directory: str, gen: int):
        if gen == 0:
            return EMPTY
        data = hlog.read_file(os.path.join(directory, hlog.snap_name(gen)))
        return None if data is None else hlog.decode_snapshot(data)

    def _bulk(self, no: int, base) -> None:
        """Index a snapshot's entries (under the lock): the loop of a restart, kept lean."""
        t = self.t
        idents, files, entries = base
        nums = [t.idents.number(i) for i in idents]
        own = t.own if no == 0 else None
        if own is not None:
            for number, length, count in files:
                own[number] = OwnFile(number, length, min(count, slots.SLOTS))
        put, counts, node = t.table.put, t.idents.counts, no << 36
        for h, v in _ENTRY.iter_unpack(entries):
            i = v >> 48
            ino = nums[i] if i < len(nums) else None
            if ino is None:
                continue
            if put(h, ino << 48 | node | low(v)) is None:
                counts[ino] += 1
            if own is not None and (f := own.get(low(v) >> 6)) is not None:
                s = v & 63
                f.live += not f.hashes[s]
                f.hashes[s], f.idents[s] = h, ino

    # -- tailing ------------------------------------------------------------------------
    def drain(self, no: int) -> int:
        """Apply what node `no` appended since the last read; the records applied."""
        t, p = self.t, self.t.peers[no]
        tail = p.tail
        if tail is None or p.broken:
            return 0
        n = 0
        try:
            while True:
                records, more = tail.read()
                t.discovery["log_reads"] += 1
                nxt = self._apply_all(no, records)
                n += len(records)
                if nxt is not None:
                    tail.follow(nxt)
                elif not more:
                    break
        except OSError as exc:
            p.broken = True
            log.warning("3FS tier: reading node %s's log failed: %s", p.name, exc)
        t.damaged += tail.damaged
        tail.damaged = 0
        t.discovery["records"] += n
        return n

    def _apply_all(self, no: int, records: list) -> int | None:
        """Apply records under the lock; the generation a NEXT names, else None. Another
        node's PUT (nearly every record a poll reads) is applied inline: the per-record
        cost is the discovery CPU (about 4 us where a call per record made it 9)."""
        t, nxt = self.t, None
        tag, put, numbers, counts = t.peers[no].tag, t.table.put, t.idents.numbers, t.idents.counts
        tell, node, digest = t.listener is not None and not t._quiet, no << 36, _xxh3
        with t._lock:
            for rec in records:
                op = rec.op
                if op == hlog.PUT and no and rec.node == tag and rec.slot < 64:
                    ino = numbers.get(rec.ident)
                    h = rec.h
                    if ino is not None and rec.file <= MAX_FILE:
                        if h != (digest(rec.ident + rec.key.encode()) or 1):
                            t.damaged += 1  # forged without care: not its key's hash
                        elif put(h, ino << 48 | node | rec.file << 6 | rec.slot) is None:
                            counts[ino] += 1
                            if tell:
                                self.told.append((rec.ident, rec.key, True))
                        continue
                if op == hlog.NEXT:
                    nxt = rec.file
                    break
                self._apply(no, rec)
        return nxt

    def _apply(self, no: int, rec: hlog.Record) -> None:
        t = self.t
        if rec.op == hlog.DROP:
            if no == 0:
                for f, which in t._drop_locked(rec.ident):
                    for s in which:
                        f.hashes[s], f.live = 0, f.live - 1
            else:
                t._drop_locked(rec.ident)
                self.drops.append(rec.ident)
            return
        if rec.file > MAX_FILE or rec.slot >= slots.SLOTS:
            t.damaged += 1
            return
        if rec.op == hlog.PUT:
            self._put(no, rec)
            return
        target = t.by_tag.get(rec.node)
        ino = t.idents.numbers.get(rec.ident)
        if target is None or ino is None:
            return
        h = rec.h
        if rec.key and h != page_hash(rec.ident, rec.key):
            t.damaged += 1
            return
        if t.table.remove(h, pack(ino, target, rec.file, rec.slot)) is not None:
            t.idents.counts[ino] -= 1
            if rec.key and t.listener is not None and not t._quiet:
                self.told.append((rec.ident, rec.key, False))
        if target == 0 and no == 0:
            t._unslot(rec.file, rec.slot, h)
        elif target == 0:
            self.frees.append((rec.file, rec.slot, h))

    def _put(self, no: int, rec: hlog.Record) -> None:
        t = self.t
        if rec.node != t.peers[no].tag or rec.h != page_hash(rec.ident, rec.key):
            t.damaged += 1  # a record in the wrong log, or forged without care
            return
        ino = t.idents.numbers.get(rec.ident)
        if ino is None and (ino := t.idents.number(rec.ident)) is None:
            return
        if t.table.put(rec.h, ino << 48 | no << 36 | rec.file << 6 | rec.slot) is None:
            t.idents.counts[ino] += 1
            if t.listener is not None and not t._quiet:
                self.told.append((rec.ident, rec.key, True))
        if no == 0:
            self._own_put(rec, ino)

    def _own_put(self, rec: hlog.Record, ino: int) -> None:
        own = self.t.own
        f: OwnFile | None = own.get(rec.file)
        if f is None:
            f = own[rec.file] = OwnFile(rec.file, rec.length)
        if f.length != rec.length:
            self.t.damaged += 1
            return
        f.live += not f.hashes[rec.slot]
        f.hashes[rec.slot], f.idents[rec.slot] = rec.h, ino

    def settle(self) -> None:
        """Outside the lock: tell the listener, free own pages other nodes deleted or
        dropped (logging this node's DELs)."""
        t = self.t
        told, self.told = self.told, []
        for ident, key, present in told:
            t.changed(ident.hex(), [key], present)
        frees, self.frees = self.frees, []
        drops, self.drops = self.drops, []
        by_file: dict[int, list[int]] = {}
        for file, slot, h in frees:
            f = t.own.get(file)
            if f is not None and f.hashes[slot] == h:
                by_file.setdefault(file, []).append(slot)
        done: list[OwnFile] = []
        for file, which in by_file.items():
            f = t.own[file]
            if t._forget_own(f, which) is not None:
                done.append(f)
        for ident in drops:
            with t._lock:
                mine = t._drop_locked(ident)  # (none left when the DROP was applied)
            for f, which in mine:
                t._forget_own(f, which)
                done.append(f)
        t._reap(done)

    def _tidy_own(self) -> None:
        """Remove this node's slot files no page is in (a crash before any publish, files
        every page left) and abandoned temporaries; count what stays (slots a file from
        its size, the bytes of its log generations)."""
        t = self.t
        me, now, top, kept = t.peers[0], time.time(), -1, 0
        current = hlog.log_name(t.log.gen) if t.log is not None else ""
        with os.scandir(me.dir) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if slots.NAME.fullmatch(e.name):
                    number = int(e.name[:8], 16)
                    top = max(top, number)
                    f = t.own.get(number)
                    if f is None or not f.live:
                        t.own.pop(number, None)
                        pagefile._unlink(e.path)
                    else:
                        f.count = f.next = max(
                            1, min(slots.SLOTS, st.st_size // slots.stride(f.length))
                        )
                elif e.name.startswith(pagefile.TMP_PREFIX):
                    if pagefile.abandoned(e.name, st.st_mtime, now):
                        pagefile._unlink(e.path)
                elif e.name.startswith(("log.", "snap.")) and e.name != current:
                    kept += st.st_size
        for number in [n for n, f in t.own.items() if not f.live]:
            del t.own[number]
        t.next_file = max(top, *t.own, -1) + 1
        t.used = sum(f.size for f in t.own.values())
        if t.log is not None:
            t.log.kept = kept


def _of_node(no: int):
    """A test of packed locations: those of node `no`."""
    return lambda where: where >> 36 & (MAX_NODES - 1) == no


def claim(t: Hf3fsTier) -> Peer:
    """This node's directory, locked (flock) against another live sidecar of that name:
    a held name gets a suffix (.1, .2 ...)."""
    base = os.path.join(t.root, "nodes")
    make_dir(t, t.root)
    make_dir(t, base)
    for i in range(64):
        name = t.node_hint if i == 0 else f"{t.node_hint}.{i}"
        directory = os.path.join(base, name)
        make_dir(t, directory)
        fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
                     | os.O_NOFOLLOW, t.file_mode)  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        except OSError as exc:  # a file system without flock: names must be unique
            log.warning("3FS tier: cannot lock %s (%s): node names must be unique", name, exc)
        t._lock_fd = fd
        return Peer(name, directory)
    raise OSError(errno.EBUSY, f"64 live sidecars hold node names {t.node_hint}.*")


def make_dir(t: Hf3fsTier, d: str) -> None:
    try:
        os.mkdir(d, t.dir_mode)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(d).st_mode):
            raise OSError(errno.ENOTDIR, f"{d} is a link or not a directory") from None
        return
    if t.group is not None:
        os.chown(d, -1, t.group)
    os.chmod(d, t.dir_mode)


def snapshot(t: Hf3fsTier, gen: int) -> bytes:
    """This node's live pages as snapshot bytes (under the log's lock: own slots change
    only under it)."""
    with t._lock:
        files = [f for f in t.own.values() if f.live or not f.full]
        idents = list(t.idents.raw)
    entries = bytearray()
    for f in files:
        for s in range(slots.SLOTS):
            if f.hashes[s]:
                v = f.idents[s] << 48 | f.number << 6 | s
                entries += f.hashes[s].to_bytes(8, "little") + v.to_bytes(8, "little")
    table = [(f.number, f.length, f.count) for f in files]
    return hlog.encode_snapshot(gen, idents, table, bytes(entries))
