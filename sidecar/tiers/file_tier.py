"""A directory of page files: the local file tier (embedded default) and, with `shared=True`,
the 3FS tier (a directory on the 3FS FUSE mount that every node sees).

    <root>/<spec identity (32 hex)>/<key>.pg     (see pagefile.py)

One flat directory per identity: a batch of writes then needs one directory fsync, where
hash-sharded subdirectories cost one fsync per touched shard (ext4 indexes large
directories, so a flat one stays fast).

Content-addressed by the namespace spec's identity and the key, so any process or node with
the same spec finds the same pages, and concurrent writers of one key publish identical
bytes by rename. The index (identity -> key -> file size, plus a global LRU) lives in memory
and is rebuilt by one scan at start; requests never scan. A shared tier also checks the
file system on an index miss (another node may have written the page) and rescans in the
background. Every I/O error degrades to a miss or a `False`, with a counter and a log line.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from itertools import repeat

from sidecar.tiers import pagefile
from sidecar.tiers.base import Tier, TierStats

log = logging.getLogger("kv_sidecar.tiers")
_IDENTITY_LEN = 32
ENOSPC_RETRIES = 3
__all__ = ["FileTier", "TierStats"]


_NONE: dict = {}  # the index of an identity with no page yet (never written to)


class FileTier(Tier):
    """Pages as files under `root`, at most `capacity` bytes (None: no limit). Files are
    0600 and directories 0700; with `group` (a shared 3FS directory that several nodes'
    sidecars write under one group) files are 0640 and directories 2770 of that group."""

    def __init__(
        self,
        name: str,
        root: str,
        capacity: int | None = None,
        shared: bool = False,
        group: int | None = None,
    ):
        self.name = name
        self.group = group
        self.file_mode, self.dir_mode = (0o600, 0o700) if group is None else (0o640, 0o2770)
        self.root = os.path.abspath(root)
        self.capacity = capacity
        # sizes the tier from the bytes recovery found (the default size: sidecar/datadir.py),
        # so start-up reads no page file twice; set by the caller, None: `capacity` stands
        self.sizer: Callable[[int], int] | None = None
        self.shared = shared
        self.where = self.root
        self.keys: dict[str, dict[str, int]] = {}
        # least recent first: the pages `recover` found, oldest mtime first, from `_cold_at`
        # on (stale entries, since forgotten or touched, are skipped), then `lru`: pages
        # added or read since, in order. Recovery builds no per-page LRU node (1M pages)
        self._cold: tuple[list[str], list[str]] = ([], [])  # (identities, keys)
        self._cold_at = 0
        self.lru: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.used = 0
        self.reserved = 0  # bytes of writes between `_make_room` and publish
        self._publishing: Counter[tuple[str, str]] = Counter()  # renamed, not yet indexed
        self._scan_log: dict | None = None  # index changes while `recover` scans
        self.stats = TierStats()
        self.degraded: str | None = None
        self._lock = threading.Lock()
        self._quiet = False  # True while `recover` rebuilds the index (no listener calls)
        self._dirs: set[str] = set()
        self._last_log = 0.0

    # -- index ------------------------------------------------------------------------
    def contains(self, identity: str, key: str) -> bool:
        keys = self.keys.get(identity)
        if keys is not None and key in keys:
            return True
        return self.shared and self._adopt(identity, key)

    def index(self, identity: str):
        """The identity's index (a dict by key) where `contains` is its look-up alone: not
        for a shared tier (a miss checks the disk), nor a subclass with its own `contains`."""
        if self.shared or type(self).contains is not FileTier.contains:
            return None
        return self.keys.get(identity, _NONE)

    def count(self, identity: str) -> int:
        return len(self.keys.get(identity, ()))

    def _adopt(self, identity: str, key: str) -> bool:
        """Shared tier: another node may have published the page; take it into the index."""
        try:
            size = os.stat(self._path(identity, key)).st_size
        except OSError:
            return False
        with self._lock:
            if (identity, key) not in self._publishing:  # else its writer indexes it
                self._add(identity, key, size)
        return True

    def held_keys(self, identity: str) -> list:
        with self._lock:
            return list(self.keys.get(identity, ()))

    def _add(self, identity: str, key: str, size: int) -> None:
        keys = self.keys.setdefault(identity, {})
        old = keys.get(key)
        if old is not None:
            self.used -= old
        elif not self._quiet:
            self.changed(identity, [key], True)
        keys[key] = size
        self.lru[(identity, key)] = size
        self.lru.move_to_end((identity, key))
        self.used += size
        if self._scan_log is not None:
            self._scan_log[(identity, key)] = size

    def _forget(self, identity: str, key: str) -> bool:
        keys = self.keys.get(identity)
        if keys is None or key not in keys:
            return False
        self.used -= keys.pop(key)
        self.lru.pop((identity, key), None)  # (or a stale entry of `_cold`)
        if self._scan_log is not None:
            self._scan_log[(identity, key)] = None
        if not self._quiet:
            self.changed(identity, [key], False)
        return True

    def _path(self, identity: str, key: str) -> str:
        return os.path.join(self.root, identity, pagefile.page_name(key))

    # -- writes (tier writer threads) -------------------------------------------------
    def write_batch(self, jobs: list[tuple[str, str, memoryview]]) -> list[bool]:
        """Publish pages: write each under a temporary name, fdatasync them, rename them,
        then fsync each directory once."""
        ok, written = [False] * len(jobs), []
        for i, (identity, key, page) in enumerate(jobs):
            directory = os.path.dirname(self._path(identity, key))
            try:
                tmp, fd, size = self._write_temp(directory, key, page)
            except OSError as exc:
                self._failed("write", exc)
                self._dirs.discard(directory)  # it may have vanished: make it again next time
                continue
            written.append((i, identity, key, tmp, fd, directory, size))
        synced, dirs = [], set()
        for i, identity, key, tmp, fd, directory, size in written:
            try:
                os.fdatasync(fd)
                self._make_room(size)
                try:
                    with self._lock:  # a rescan from now on leaves it to this writer
                        self._publishing[(identity, key)] += 1
                    os.rename(tmp, self._path(identity, key))
                except OSError:
                    self._unreserve(size, [(identity, key)])
                    raise
            except OSError as exc:
                self._failed("publish", exc)
                pagefile._unlink(tmp)
                continue
            finally:
                os.close(fd)
            synced.append((i, identity, key, size))
            dirs.add(directory)
        try:
            for d in dirs:
                pagefile.fsync_dir(d)
        except OSError as exc:
            self._failed("fsync", exc)
            self._unreserve(
                sum(size for *_, size in synced), [(ident, key) for _, ident, key, _ in synced]
            )
            return ok
        with self._lock:
            for i, identity, key, size in synced:
                ok[i] = True
                self.reserved -= size
                self._published([(identity, key)])
                self._add(identity, key, size)
                self.stats.pages_written += 1
                self.stats.bytes_written += size
        return ok

    def _write_temp(self, directory: str, key: str, page) -> tuple[str, int, int]:
        """`pagefile.write_temp`, making a vanished directory again (once) and, when the
        file system is full (ENOSPC), evicting this tier's least recent pages and retrying."""
        remade = False
        for attempt in range(ENOSPC_RETRIES + 1):
            self._ensure_dir(directory)
            try:
                return pagefile.write_temp(directory, key, page, self.file_mode)
            except FileNotFoundError:
                if remade:
                    raise
                remade = True
                self._dirs.discard(directory)
            except OSError as exc:
                if exc.errno != errno.ENOSPC or attempt == ENOSPC_RETRIES:
                    raise
                need = max(len(memoryview(page).cast("B")) + pagefile.BLOCK, self.used // 64)
                if not self._evict_bytes(need):
                    raise
                log.warning(
                    "%s tier: the file system is full; evicted least recent pages and retrying",
                    self.name,
                )
        raise OSError(errno.ENOSPC, "no space left after evicting")

    def _evict_bytes(self, want: int) -> int:
        """Remove least recent pages until `want` bytes are freed; return the bytes freed."""
        freed = 0
        while freed < want:
            with self._lock:
                oldest = self._oldest()
                if oldest is None:
                    break
                (identity, key), size = oldest
                self._forget(identity, key)
                self.stats.evictions += 1
            pagefile._unlink(self._path(identity, key))
            freed += size
        return freed

    def _oldest(self) -> tuple[tuple[str, str], int] | None:
        """The least recent page and its size (None: none); under the lock."""
        idents, keys = self._cold
        while self._cold_at < len(keys):
            page = idents[self._cold_at], keys[self._cold_at]
            size = self.keys.get(page[0], {}).get(page[1])
            if size is not None and page not in self.lru:
                return page, size
            self._cold_at += 1
        if keys:
            self._cold, self._cold_at = ([], []), 0
        return next(iter(self.lru.items()), None)

    def _ensure_dir(self, directory: str) -> None:
        if directory not in self._dirs:
            self._make_dir(directory)
            self._dirs.add(directory)

    def _make_dir(self, directory: str) -> None:
        """Create `directory` (and a missing root) with this tier's mode and group. One
        already there must be a real directory: pages are never written through a link."""
        for d in (self.root, directory):
            try:
                os.mkdir(d, self.dir_mode)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(d).st_mode):
                    raise OSError(errno.ENOTDIR, f"{d} is a link or not a directory") from None
                continue
            if self.group is not None:
                os.chown(d, -1, self.group)
            os.chmod(d, self.dir_mode)  # not narrowed by the umask, setgid kept

    def _make_room(self, size: int) -> None:
        """Reserve `size` bytes under the capacity, evicting least recent pages: the check
        and the reservation are one step, so concurrent writers never overshoot. The
        caller publishes (`reserved -= size` with `_add`) or calls `_unreserve`."""
        if self.capacity is not None and size > self.capacity:
            raise OSError(errno.EFBIG, f"a page of {size} bytes is over the tier's capacity")
        while True:
            with self._lock:
                over = self.used + self.reserved + size - (self.capacity or 0)
                if self.capacity is None or over <= 0:
                    self.reserved += size
                    return
            if not self._evict_bytes(over):
                raise OSError(errno.ENOSPC, "the tier's capacity is held by writes in flight")

    def _unreserve(self, size: int, publishing: list[tuple[str, str]] | None = None) -> None:
        with self._lock:
            self.reserved -= size
            assert self.reserved >= 0, self.reserved
            self._published(publishing or ())

    def _published(self, pages) -> None:
        """Writes of `pages` ended (indexed or failed); under the lock."""
        for page in pages:
            left = self._publishing[page] - 1
            assert left >= 0, f"{page} ended more writes than it began"
            if left:
                self._publishing[page] = left
            else:
                del self._publishing[page]

    # -- reads (copy executor threads) ------------------------------------------------
    def read(self, identity: str, key: str, dst: memoryview) -> bool:
        """Fill `dst` with a verified page; a missing, torn or corrupt file is a miss."""
        path = self._path(identity, key)
        try:
            good = pagefile.read_into(path, key, dst)
        except FileNotFoundError:
            with self._lock:
                self._forget(identity, key)
            return False
        except OSError as exc:
            self._failed("read", exc)
            return False
        if not good:
            with self._lock:
                self._forget(identity, key)
                self.stats.corrupt += 1
            log.warning("%s tier: %s/%s is torn or corrupt; removed", self.name, identity, key)
            pagefile._unlink(path)
            return False
        with self._lock:
            if (identity, key) in self.lru:
                self.lru.move_to_end((identity, key))
            elif key in self.keys.get(identity, ()):  # a recovered page: now the most recent
                self.lru[(identity, key)] = self.keys[identity][key]
            self.stats.pages_read += 1
            self.stats.bytes_read += len(dst)
        return True

    def delete(self, identity: str, keys: list[str]) -> int:
        """Remove pages; return how many this tier knew. A file that cannot be removed
        (read-only or failing disk) stays in the index: the caller reports it as failed."""
        n = 0
        for key in keys:
            with self._lock:
                size = self.keys.get(identity, {}).get(key)
                self._forget(identity, key)
            if size is None and not self.shared:
                continue
            try:
                pagefile.remove(self._path(identity, key))
            except OSError as exc:
                self._failed("delete", exc)
                if size is None:
                    self._adopt(identity, key)
                else:
                    with self._lock:
                        self._add(identity, key, size)
                continue
            n += size is not None
        return n

    def drop(self, identity: str) -> None:
        """Remove every page file of one identity (those other nodes wrote too) and its
        directory; pages that cannot be removed stay in the index (`count` shows them)."""
        directory = os.path.join(self.root, identity)
        with self._lock:
            known = list(self.keys.get(identity, ()))
        self.delete(identity, known)
        try:
            with os.scandir(directory) as it:
                names = [
                    e.name[: -len(pagefile.SUFFIX)] for e in it if pagefile.is_page_name(e.name)
                ]
        except FileNotFoundError:
            names = []
        except OSError as exc:
            self._failed("delete", exc)
            names = []
        with self._lock:
            kept = self.keys.get(identity, {})
            names = [n for n in names if n not in kept]  # (those failed once already)
        if names:
            self._delete_unknown(identity, names)
        self._dirs.discard(directory)
        with self._lock:
            if not self.keys.get(identity):
                self.keys.pop(identity, None)
        with contextlib.suppress(OSError):  # fails while another writer's temporary is there
            os.rmdir(directory)

    def _delete_unknown(self, identity: str, keys: list[str]) -> None:
        for key in keys:
            try:
                pagefile.remove(self._path(identity, key))
            except OSError as exc:
                self._failed("delete", exc)
                self._adopt(identity, key)

    def _failed(self, what: str, exc: OSError) -> None:
        with self._lock:
            self.stats.failed(what)
            self.degraded = f"{what}: {exc.strerror or exc}"
        now = time.monotonic()
        if now - self._last_log > 10:  # one line per 10 s, not one per page
            self._last_log = now
            log.error("%s tier %s failed: %s (serving from the host pool)", self.name, what, exc)

    # -- recovery ---------------------------------------------------------------------
    def recover(self) -> int:
        """Rebuild the index from the directory (LRU order by mtime); remove abandoned
        temporaries (pagefile.abandoned), never another live writer's. The new index is
        built aside in bulk (1,000,000 pages: loadtest/micro/recovery.py) and swapped in."""
        with self._lock:
            self._scan_log = {}
        try:
            os.makedirs(os.path.dirname(self.root), exist_ok=True)
            self._make_dir(self.root)
            scans = []
            for ident in _subdirs(self.root, _IDENTITY_LEN):
                try:
                    scans.append((ident, *self._scan_dir(os.path.join(self.root, ident))))
                except FileNotFoundError:  # dropped meanwhile (another node deleted the namespace)
                    continue
        except BaseException:
            with self._lock:
                self._scan_log = None
            raise
        keys, cold, used = _build_index(scans)
        with self._lock:
            changed, self._scan_log = self._scan_log or {}, None
            before = {i: set(k) for i, k in self.keys.items()} if self.listener else None
            # changed meanwhile, or renamed by a writer that has not indexed it yet (its
            # bytes are still in `reserved`: counting them twice would evict them); their
            # entries in `cold` go stale
            for ident, key in changed.keys() | self._publishing.keys():
                used -= keys.get(ident, {}).pop(key, 0)
            self.keys.clear()
            self.keys.update((i, k) for i, k in keys.items() if k)
            self._cold, self._cold_at, self.lru, self.used = cold, 0, OrderedDict(), used
            self._quiet = True  # the index is rebuilt: listeners hear the difference once
            for (ident, key), size in changed.items():  # what happened during the scan wins
                if size is not None:
                    self._add(ident, key, size)
            self._quiet = False
            if before is not None:
                self._tell_difference(before)
            if self.sizer is not None:
                self.capacity = self.sizer(self.used)
        self._make_room(0)
        return sum(len(names) for _, names, _, _ in scans)

    def _tell_difference(self, before: dict) -> None:
        """After a rescan: tell the listener what came (other nodes' pages) and went."""
        for ident in before.keys() | self.keys.keys():
            old, new = before.get(ident, set()), self.keys.get(ident, {}).keys()
            self.changed(ident, [k for k in new if k not in old], True)
            self.changed(ident, [k for k in old if k not in new], False)

    def _scan_dir(self, directory: str) -> tuple[list, list, list]:
        """(keys, sizes, mtimes) of the pages in one directory; removes temporaries no live
        writer can publish. One thread: stat threads fight over the GIL (1,000,000 pages:
        4.4 s on one thread, 6 s on two, 8.4 s on four, two idle cores)."""
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return _stat_pages(fd, directory, os.listdir(fd), time.time())
        finally:
            os.close(fd)

    def pages(self) -> int:
        return sum(map(len, list(self.keys.values())))

    def describe(self) -> dict:
        return {
            "root": self.root,
            "pages": self.pages(),
            "bytes": self.used,
            "capacity": self.capacity,
            "shared": self.shared,
            "degraded": self.degraded,
            **asdict(self.stats),
        }


def _stat_pages(fd: int, directory: str, names: list[str], now: float) -> tuple[list, list, list]:
    """(keys, sizes, mtimes) of the pages among `names` in the directory open as `fd`;
    unlinks abandoned temporaries. The per-file loop of a recovery: keep it lean."""
    keys, sizes, mtimes = [], [], []
    shared: dict[int, int] = {}  # one int object a size: a namespace's pages have one or two
    is_page, is_reg, cut, lstat = (
        pagefile.page_name_match,
        stat.S_ISREG,
        -len(pagefile.SUFFIX),
        os.stat,
    )
    for name in names:
        try:
            st = lstat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:  # published or removed meanwhile
            continue
        if not is_reg(st.st_mode):
            continue
        if is_page(name):
            keys.append(name[:cut])
            size = st.st_size
            sizes.append(shared.setdefault(size, size))
            mtimes.append(st.st_mtime)
        elif pagefile.abandoned(name, st.st_mtime, now):
            pagefile._unlink(os.path.join(directory, name))  # a write that will never publish
    return keys, sizes, mtimes


def _build_index(scans: list) -> tuple[dict, tuple[list, list], int]:
    """(identity -> key -> size, (identities, keys) oldest mtime first, bytes) from
    `_scan_dir` results [(identity, keys, sizes, mtimes)], by C loops (zip, map, sort)."""
    keys: dict[str, dict] = {}
    idents: list[str] = []
    names: list[str] = []
    mtimes: list[float] = []
    used = 0
    for ident, found, sizes, mt in scans:
        keys[ident] = dict(zip(found, sizes, strict=True))
        idents += repeat(ident, len(found))
        names += found
        mtimes += mt
        used += sum(sizes)
    order = sorted(range(len(names)), key=mtimes.__getitem__)
    return keys, (list(map(idents.__getitem__, order)), list(map(names.__getitem__, order))), used


def _subdirs(path: str, length: int) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [
                e.name
                for e in it
                if len(e.name) == length
                and e.is_dir(follow_symlinks=False)
                and all(c in "0123456789abcdef" for c in e.name)
            ]
    except FileNotFoundError:
        return []
