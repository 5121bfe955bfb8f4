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
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                           capture_output=True, text=True)
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
    where = tmpfs("size=64m")
    with open(os.path.join(where, "held"), "wb") as f:   # what the tier already holds
        f.write(b"h" * (8 << 20))
    st = os.statvfs(where)
    want = int(0.9 * (st.f_bavail * st.f_frsize + (8 << 20)))
    p = spawn("--host-pool", "16MiB", "--data-dir", where).wait_ready()
    capacity = SidecarClient(p.url).stats()["tiers"]["file"]["capacity"]
    assert abs(capacity - want) <= 64 * 1024 and 0.85 * (64 << 20) < capacity < 0.9 * (64 << 20) + 1
    assert f"file tier {where}: {capacity} bytes (default: min(64 GiB, 90% of" in p.output()
    p2 = spawn("--host-pool", "16MiB", "--data-dir", where, "--file-tier-size", "1GiB").wait_ready()
    assert SidecarClient(p2.url).stats()["tiers"]["file"]["capacity"] == 2**30   # the flag wins


def test_the_default_size_is_capped(monkeypatch, tmp_path):
    class Big:
        f_bavail, f_frsize = 10**9, 4096        # 4 TB free
    monkeypatch.setattr(datadir.os, "statvfs", lambda path: Big)
    config = replace(Config(), data_dir=str(tmp_path))
    assert datadir.file_tier_size(config)[0] == 64 * 2**30
    Big.f_bavail = 1000
    (tmp_path / "page").write_bytes(b"p" * 40960)
    assert datadir.file_tier_size(config)[0] == int(0.9 * (1000 * 4096 + 40960))
