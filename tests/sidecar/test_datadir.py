"""Start-up with an unusable data directory, and the file tier's default size (issue 11,
item 8): a real `sidecar serve` exits 1 with one line naming the directory; the default
size follows the file system's free space."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace

import pytest

from api.engine.client import SidecarClient
from sidecar import datadir
from sidecar.config import Config
from sidecar.tiers import pagefile


def exits_with_one_line(spawn, data_dir: str, reason: str) -> None:
    p = spawn("--host-pool", "16MiB", "--data-dir", data_dir)
    assert p.proc.wait(timeout=60) == 1
    out = p.output()
    assert f"cannot start: --data-dir {data_dir} is unusable: {reason}" in out, out
    assert "--no-file-tier" in out and "Traceback" not in out


def test_a_file_where_the_data_dir_should_be(spawn, tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    exits_with_one_line(spawn, str(tmp_path / "file"), "File exists")
    exits_with_one_line(spawn, str(tmp_path / "file" / "sub"), "Not a directory")


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a tmpfs (root only; skipped where mount is refused)."""
    mounted = []

    def mount(options: str) -> str:
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(where)
        return str(where)

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_read_only_data_dir(spawn, tmpfs):
    where = tmpfs("ro,size=1m")
    exits_with_one_line(spawn, where, "Read-only file system")
    exits_with_one_line(spawn, os.path.join(where, "kv"), "Read-only file system")


def test_the_default_size_follows_the_free_space(spawn, tmpfs):
    where = tmpfs("size=64m,mode=0700")  # a tmpfs root is 1777 unless told: refused as squattable
    ident = os.path.join(where, "ab" * 16)  # what the tier already holds: 128 page files
    os.mkdir(ident, 0o700)
    held = 0
    for i in range(128):
        body = bytes([i]) * (64 << 10)
        data = pagefile.encode_header(f"k{i}", body) + body
        with open(os.path.join(ident, pagefile.page_name(f"k{i}")), "wb") as f:
            f.write(data)
        held += len(data)
    with open(os.path.join(where, "not-a-page"), "wb") as f:  # not the tier's: not counted
        f.write(b"x" * (1 << 20))
    st = os.statvfs(where)
    want = int(0.9 * (st.f_bavail * st.f_frsize + held))
    p = spawn("--host-pool", "16MiB", "--data-dir", where).wait_ready()
    capacity = SidecarClient(p.url).stats()["tiers"]["file"]["capacity"]
    assert abs(capacity - want) <= 64 * 1024 and 0.85 * (64 << 20) < capacity < 0.9 * (64 << 20) + 1
    assert f"file tier {where}: {capacity} bytes (default: min(64 GiB, 90% of" in p.output()
    assert f"{held} bytes held" in p.output()  # counted by the recovery scan, no second walk
    p2 = spawn("--host-pool", "16MiB", "--data-dir", where, "--file-tier-size", "1GiB").wait_ready()
    assert SidecarClient(p2.url).stats()["tiers"]["file"]["capacity"] == 2**30  # the flag wins


def test_the_default_size_is_capped(monkeypatch, tmp_path):
    class Big:
        f_bavail, f_frsize = 10**9, 4096  # 4 TB free

    monkeypatch.setattr(datadir.os, "statvfs", lambda path: Big)
    config = replace(Config(), data_dir=str(tmp_path))
    assert datadir.file_tier_size(config)[0] == 64 * 2**30
    Big.f_bavail = 1000
    (tmp_path / "page").write_bytes(b"p" * 40960)
    assert datadir.file_tier_size(config)[0] == int(0.9 * (1000 * 4096 + 40960))


# -- squatted directories (issue 26, item 8) ----------------------------------------------
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
NOBODY = 65534


@root_only
def test_a_data_dir_another_user_made_first_is_refused(spawn, tmp_path):
    squat = tmp_path / "squat"
    squat.mkdir()
    os.chown(squat, NOBODY, NOBODY)
    exits_with_one_line(spawn, str(squat), f"it is owned by uid {NOBODY}")
    assert list(squat.iterdir()) == []  # nothing was written into it


def test_a_data_dir_others_can_write_or_a_link_is_refused(spawn, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    exits_with_one_line(spawn, str(shared), f"it is owned by uid {os.geteuid()}, mode 777")
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "link")
    exits_with_one_line(spawn, str(tmp_path / "link"), "it is a symlink")
    deep = tmp_path / "open" / "data"
    deep.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "open", 0o777)  # a parent anyone can rename things in
    exits_with_one_line(spawn, str(deep), f"{tmp_path / 'open'} above it")


@root_only
def test_a_socket_dir_another_user_made_first_is_refused(spawn, tmp_path):
    squat = tmp_path / "run"
    squat.mkdir(mode=0o755)
    os.chown(squat, NOBODY, NOBODY)
    p = spawn("--host-pool", "16MiB", "--no-file-tier", socket=str(squat / "s.sock"))
    assert p.proc.wait(timeout=60) == 1
    out = p.output()
    assert (
        f"cannot listen: the socket directory {squat} is unusable: it is owned by uid {NOBODY}"
        in out
    ), out
    assert "Traceback" not in out and not (squat / "s.sock").exists()


def test_the_file_tier_never_writes_through_a_planted_link(tmp_path):
    """An identity directory replaced by a link to elsewhere: the write fails (a miss,
    counted), nothing lands where the link points."""
    from sidecar.tiers.file_tier import FileTier

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tier = FileTier("file", str(tmp_path / "data"), 1 << 20)
    tier.recover()
    ident = "a" * 32
    os.symlink(elsewhere, tmp_path / "data" / ident)
    assert tier.write_batch([(ident, "k", b"x" * 4096)]) == [False]
    assert list(elsewhere.iterdir()) == [] and tier.stats.write_errors == 1
    assert not tier.contains(ident, "k")
