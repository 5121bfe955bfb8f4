"""The file tier under faults: temporaries no key can collide with and only abandoned ones
removed, a shared directory with two writers, ENOSPC (injected and on a real small tmpfs),
deletes the disk refuses (injected and on a real read-only mount)."""

import errno
import os
import subprocess
import threading
import time

import pytest

from sidecar.tiers import pagefile
from sidecar.tiers.file_tier import FileTier

ID = "0123456789abcdef0123456789abcdef"


def page(key, size=4096):
    import hashlib

    return hashlib.shake_256(key.encode()).digest(size)


def read(tier, key, size=4096):
    buf = bytearray(size)
    return bytes(buf) if tier.read(ID, key, memoryview(buf)) else None


def write(tier, *keys, size=4096):
    return tier.write_batch([(ID, k, memoryview(page(k, size))) for k in keys])


# -- temporaries ----------------------------------------------------------------------
def test_a_key_that_looks_like_a_temporary_survives_recovery(tmp_path):
    t = FileTier("file", str(tmp_path))
    keys = ["a.tmp.1.deadbeef", ".a.pg.tmp.77.0badcafe", "x.tmp", "tmp"]
    assert write(t, *keys) == [True] * 4
    for _ in range(2):  # every recovery, not only the first
        fresh = FileTier("file", str(tmp_path))
        assert fresh.recover() == 4
        assert all(read(fresh, k) == page(k) for k in keys)


def test_a_temporary_name_is_never_a_page_name():
    name = pagefile.temp_name()
    assert name.startswith("~") and not pagefile.is_page_name(name)
    assert not pagefile.is_page_name(name + pagefile.SUFFIX)


def _fake_temp(directory, node, boot, pid, age):
    path = os.path.join(directory, f"~{node}~{boot}~{pid}~0123abcd.tmp")
    with open(path, "wb") as f:
        f.write(b"partial")
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_recovery_removes_only_provably_abandoned_temporaries(tmp_path):
    t = FileTier("hf3fs", str(tmp_path), shared=True)
    write(t, "a")
    d = os.path.dirname(t._path(ID, "a"))
    dead = _dead_pid()
    young, old = 5, pagefile.TEMP_MAX_AGE + 60
    keep = [
        _fake_temp(d, "other-node-1", "ab" * 16, 4242, young),  # another node, live
        _fake_temp(d, pagefile.NODE, pagefile.BOOT, os.getpid(), young),
    ]  # a live writer here
    gone = [
        _fake_temp(d, "other-node-2", "cd" * 16, 4242, old),  # older than the bound
        _fake_temp(d, pagefile.NODE, "ef" * 16, os.getpid(), young),  # this node, earlier boot
        _fake_temp(d, pagefile.NODE, pagefile.BOOT, dead, young),
    ]  # this node, exited pid
    assert FileTier("hf3fs", str(tmp_path), shared=True).recover() == 1
    assert all(os.path.exists(p) for p in keep)
    assert not any(os.path.exists(p) for p in gone)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_rescan_on_another_instance_never_removes_a_live_writers_temporary(tmp_path, monkeypatch):
    """Two instances on one shared directory: A's write is held between writing its
    temporary and the rename while B recovers (its periodic rescan); the temporary survives
    and A's write publishes."""
    a = FileTier("hf3fs", str(tmp_path), shared=True)
    b = FileTier("hf3fs", str(tmp_path), shared=True)
    a.recover(), b.recover()
    real = pagefile.write_temp
    written, release, temps = threading.Event(), threading.Event(), []

    def held(*args, **kw):
        out = real(*args, **kw)
        temps.append(out[0])
        written.set()
        assert release.wait(10)
        return out

    monkeypatch.setattr(pagefile, "write_temp", held)
    result = []
    w = threading.Thread(target=lambda: result.append(write(a, "k")))
    w.start()
    assert written.wait(10)
    b.recover()
    a.recover()  # its own rescan too
    assert os.path.exists(temps[0])
    release.set()
    w.join(10)
    assert result == [[True]]
    assert b.contains(ID, "k") and read(b, "k") == page("k")


# -- a shared directory: what a delete promises across nodes --------------------------
def test_shared_directory_delete_and_drop_across_two_nodes(tmp_path):
    a = FileTier("hf3fs", str(tmp_path), shared=True)
    b = FileTier("hf3fs", str(tmp_path), shared=True)
    write(a, "k", "j")
    assert read(b, "k") == page("k") and b.contains(ID, "j")  # adopted from A's files
    assert a.delete(ID, ["k"]) == 1
    assert not os.path.exists(a._path(ID, "k")) and not a.contains(ID, "k")
    assert read(b, "k") is None and not b.contains(ID, "k")  # B: a miss, then forgotten
    a.drop(ID)
    assert not os.path.exists(os.path.join(str(tmp_path), ID))  # the directory is gone
    assert b.recover() == 0 and not b.contains(ID, "j")  # B's next rescan sees nothing
    assert write(b, "n") == [True] and read(a, "n") == page("n")  # and writing starts again


def test_drop_removes_pages_the_index_never_knew(tmp_path):
    t = FileTier("file", str(tmp_path))
    write(t, "a", "b")
    other = FileTier("file", str(tmp_path))  # e.g. a page published after the index forgot it
    write(other, "c")
    t.drop(ID)
    assert FileTier("file", str(tmp_path)).recover() == 0 and t.count(ID) == 0


# -- ENOSPC -----------------------------------------------------------------------------
def test_injected_enospc_evicts_least_recent_pages_and_retries(tmp_path, monkeypatch):
    t = FileTier("file", str(tmp_path))
    assert write(t, "p0", "p1", "p2") == [True] * 3
    read(t, "p0")  # p0 is now the most recent: p1 goes first
    real, calls = pagefile.write_temp, []

    def full_once(*args, **kw):
        calls.append(args[1])
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(pagefile, "write_temp", full_once)
    assert write(t, "new") == [True]
    assert calls == ["new", "new"] and t.stats.evictions >= 1 and t.stats.write_errors == 0
    assert not t.contains(ID, "p1") and not os.path.exists(t._path(ID, "p1"))
    assert read(t, "p0") == page("p0") and read(t, "new") == page("new")


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB tmpfs (root only)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_real_file_system_makes_the_tier_evict_its_own_pages(small_fs):
    t = FileTier("file", str(small_fs / "tier"))  # no capacity set: only the disk limits it
    t.recover()
    size = 64 * 1024
    keys = [f"p{i}" for i in range(40)]  # 2.6 MiB through 1 MiB
    for k in keys:
        assert write(t, k, size=size) == [True], k
    assert t.stats.evictions > 0 and t.stats.write_errors == 0
    assert read(t, keys[-1], size) == page(keys[-1], size)
    assert not t.contains(ID, keys[0])
    assert FileTier("file", str(small_fs / "tier")).recover() == t.count(ID)


# -- deletes the disk refuses -----------------------------------------------------------
def test_an_injected_erofs_delete_is_reported_and_the_page_stays(tmp_path, monkeypatch):
    t = FileTier("file", str(tmp_path))
    write(t, "a", "b")

    def refuse(path):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(pagefile, "remove", refuse)
    assert t.delete(ID, ["a"]) == 0
    assert t.contains(ID, "a") and t.stats.delete_errors == 1 and "Read-only" in t.degraded
    t.drop(ID)
    assert t.count(ID) == 2  # nothing claimed gone that is still on disk
    monkeypatch.undo()
    assert t.delete(ID, ["a"]) == 1 and not t.contains(ID, "a")
    assert FileTier("file", str(tmp_path)).recover() == 1


def test_a_real_read_only_mount_fails_deletes_visibly(small_fs):
    t = FileTier("file", str(small_fs / "tier"))
    t.recover()
    write(t, "a", "b")
    if subprocess.run(["mount", "-o", "remount,ro", str(small_fs)]).returncode != 0:
        pytest.skip("cannot remount the tmpfs read-only")
    try:
        assert t.delete(ID, ["a"]) == 0 and t.contains(ID, "a")
        assert t.stats.delete_errors == 1
        t.drop(ID)
        assert t.count(ID) == 2
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    assert FileTier("file", str(small_fs / "tier")).recover() == 2  # what it said: still there
