"""Page files and the file tier: publish, verify, recover, evict, degrade."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.tiers import pagefile
from sidecar.tiers.file_tier import FileTier

ID = "0123456789abcdef0123456789abcdef"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def page(key, size=4096):
    import hashlib

    return hashlib.shake_256(key.encode()).digest(size)


def fs_type(path) -> str:
    """The file system type of the mount holding `path` (for skip reasons)."""
    best, kind = "", "an unknown file system"
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if str(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def read(tier, key, size=4096):
    buf = bytearray(size)
    return bytes(buf) if tier.read(ID, key, memoryview(buf)) else None


def test_round_trip_and_recovery(tmp_path):
    t = FileTier("file", str(tmp_path))
    assert (
        t.write_batch([(ID, k, memoryview(page(k))) for k in ("a", ".", "..", "x:y")]) == [True] * 4
    )
    assert all(t.contains(ID, k) for k in ("a", ".", "..", "x:y")) and t.count(ID) == 4
    assert read(t, "..") == page("..")
    fresh = FileTier("file", str(tmp_path))
    assert fresh.count(ID) == 0 and fresh.recover() == 4
    assert read(fresh, "x:y") == page("x:y") and read(fresh, "zz") is None


def test_unpublished_temporaries_are_never_served_and_are_cleaned(tmp_path):
    t = FileTier("file", str(tmp_path))
    t.write_batch([(ID, "a", memoryview(page("a")))])
    directory = os.path.dirname(t._path(ID, "b"))
    os.makedirs(directory, exist_ok=True)
    # a process of this node that crashed before the rename: its pid is gone
    code = (
        "import os, sys; from sidecar.tiers import pagefile; "
        "tmp, fd, _ = pagefile.write_temp(sys.argv[1], 'b', b'x' * 4096); print(tmp)"
    )
    tmp = subprocess.run(
        [sys.executable, "-c", code, directory],
        check=True,
        text=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    ).stdout.strip()
    assert os.path.exists(tmp)
    fresh = FileTier("file", str(tmp_path))
    assert fresh.recover() == 1 and not fresh.contains(ID, "b")
    assert not os.path.exists(tmp)


# flip_header: the length field; flip_header_sum: the header's own checksum, the one damage
# that only that checksum catches (every other header field is checked on its own)
@pytest.mark.parametrize(
    "damage", ["flip_page", "flip_header", "flip_header_sum", "truncate", "extend", "wrong_key"]
)
def test_damaged_files_are_misses_never_wrong_bytes(tmp_path, damage):
    t = FileTier("file", str(tmp_path))
    t.write_batch([(ID, "a", memoryview(page("a"))), (ID, "b", memoryview(page("b")))])
    path = t._path(ID, "a")
    data = bytearray(Path(path).read_bytes())
    if damage == "flip_page":
        data[100] ^= 1
    elif damage == "flip_header":
        data[20] ^= 1
    elif damage == "flip_header_sum":
        data[pagefile.HEADER.size + 3] ^= 1
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "extend":
        data += b"x"
    else:
        data = bytearray(Path(t._path(ID, "b")).read_bytes())  # b's file under a's name
    Path(path).write_bytes(data)
    fresh = FileTier("file", str(tmp_path))
    fresh.recover()
    assert read(fresh, "a") is None
    assert not fresh.contains(ID, "a") and not os.path.exists(path)  # counted and cleaned up
    assert fresh.stats.corrupt == 1
    assert read(fresh, "b") == page("b")


def test_lru_eviction_within_capacity(tmp_path):
    size = pagefile.HEADER_SIZE + 4096
    t = FileTier("file", str(tmp_path), capacity=3 * size)
    for k in "abc":
        t.write_batch([(ID, k, memoryview(page(k)))])
    assert read(t, "a") == page("a")  # a is now most recent
    t.write_batch([(ID, "d", memoryview(page("d")))])
    assert [t.contains(ID, k) for k in "abcd"] == [True, False, True, True]
    assert t.used == 3 * size and t.stats.evictions == 1
    assert not os.path.exists(t._path(ID, "b"))
    small = FileTier("file", str(tmp_path), capacity=2 * size)  # restart with a smaller limit
    small.recover()
    assert small.count(ID) == 2 and small.used == 2 * size


def test_a_rescan_between_a_batch_rename_and_its_index_keeps_the_pages(tmp_path, monkeypatch):
    """A rescan (hf3fs rescans every few seconds) that runs after a batch renamed its pages
    and before the batch indexed them: the renamed files are the writer's to index, not
    the rescan's. Counted twice (on disk and still reserved) they looked over capacity,
    so the rescan evicted them, and the batch then indexed pages whose files were gone."""
    size = pagefile.HEADER_SIZE + 4096
    t = FileTier("hf3fs", str(tmp_path), capacity=4 * size)
    fsync_dir = pagefile.fsync_dir
    rescans = []

    def rescan_first(d):  # the batch has renamed every page; it indexes them after this
        rescans.append(t.recover())
        fsync_dir(d)

    monkeypatch.setattr(pagefile, "fsync_dir", rescan_first)
    keys = ["a", "b", "c"]
    assert t.write_batch([(ID, k, memoryview(page(k))) for k in keys]) == [True] * 3
    assert rescans == [3]  # it saw the three renamed files
    assert [read(t, k) for k in keys] == [page(k) for k in keys]
    assert t.used == 3 * size and t.reserved == 0 and not t._publishing
    assert sorted(os.listdir(os.path.dirname(t._path(ID, "a")))) == sorted(
        os.path.basename(t._path(ID, k)) for k in keys
    )


def test_recovery_rebuilds_lru_by_mtime(tmp_path):
    """Recovery orders the LRU by file mtime, not by name or directory order: with mtimes
    the reverse of the names, a smaller capacity keeps the newest files."""
    size = pagefile.HEADER_SIZE + 4096
    t = FileTier("file", str(tmp_path))
    keys = ["a", "b", "c", "d"]
    t.write_batch([(ID, k, memoryview(page(k))) for k in keys])
    for age, k in enumerate(keys):  # a newest, d oldest
        os.utime(t._path(ID, k), ns=(10**18 - age * 10**9, 10**18 - age * 10**9))
    small = FileTier("file", str(tmp_path), capacity=2 * size)
    assert small.recover() == 4
    assert [small.contains(ID, k) for k in keys] == [True, True, False, False]
    small.write_batch([(ID, "e", memoryview(page("e")))])  # b is now the least recent
    assert [small.contains(ID, k) for k in ["a", "b", "e"]] == [True, False, True]


def test_enospc_and_vanished_directory_degrade(tmp_path, monkeypatch):
    t = FileTier("file", str(tmp_path / "tier"))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pagefile, "write_temp", full)
    assert t.write_batch([(ID, "a", memoryview(page("a")))]) == [False]
    assert t.stats.write_errors == 1 and "No space" in t.degraded
    monkeypatch.undo()
    assert t.write_batch([(ID, "a", memoryview(page("a")))]) == [True]
    import shutil

    shutil.rmtree(tmp_path / "tier")  # the directory vanishes under the tier
    assert read(t, "a") is None and not t.contains(ID, "a")
    assert t.write_batch([(ID, "b", memoryview(page("b")))]) == [True]  # made again


def test_shared_tier_adopts_pages_written_by_another_node(tmp_path):
    a = FileTier("hf3fs", str(tmp_path), shared=True)
    b = FileTier("hf3fs", str(tmp_path), shared=True)
    a.recover(), b.recover()
    a.write_batch([(ID, "k", memoryview(page("k")))])
    assert b.contains(ID, "k") and read(b, "k") == page("k")
    other = "f" * 32
    assert not b.contains(other, "k")  # another spec never collides


@pytest.mark.parametrize(
    "damage", [None, "flip_page", "flip_header", "flip_header_sum", "truncate"]
)
def test_aligned_pages_use_the_direct_layout_and_are_verified(tmp_path, damage):
    import mmap

    src, dst = mmap.mmap(-1, 8192), mmap.mmap(-1, 8192)  # page-aligned, like arena slots
    src.write(page("a", 8192))
    assert pagefile.direct_ok(memoryview(src))
    t = FileTier("file", str(tmp_path))
    assert t.write_batch([(ID, "a", memoryview(src))]) == [True]
    path = t._path(ID, "a")
    size = os.path.getsize(path)
    if size != pagefile.BLOCK + 8192:
        pytest.skip(
            f"O_DIRECT refused by {fs_type(tmp_path)} at {tmp_path} (the buffered layout "
            "was written): the direct layout is not exercised here"
        )
    data = bytearray(Path(path).read_bytes())
    if damage == "flip_page":
        data[pagefile.BLOCK + 5] ^= 1
    elif damage == "flip_header":
        data[30] ^= 1
    elif damage == "flip_header_sum":
        data[pagefile.HEADER.size + 3] ^= 1
    elif damage == "truncate":
        data = data[:-4096]
    Path(path).write_bytes(data)
    ok = t.read(ID, "a", memoryview(dst))
    assert ok == (damage is None)
    if ok:
        assert dst[:] == page("a", 8192)
    buffered = bytearray(8192)  # an unaligned reader still reads the direct layout
    if damage is None:
        assert t.read(ID, "a", memoryview(buffered)) and bytes(buffered) == page("a", 8192)
