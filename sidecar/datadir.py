"""Start-up checks of the tier directories, and the file tier's default size.

An unusable data directory (not creatable, not writable, a file in the way, a read-only
mount) stops the sidecar at start: one error line naming the directory and the fix, exit
status 1. Serving without the tier would answer `durable` sets and restarts differently
from what the operator configured; `--no-file-tier` is the explicit way to run without it.
"""
from __future__ import annotations

import os

from sidecar.config import Config

DEFAULT_CAP = 64 * 2**30      # the file tier's default size is at most this
FREE_SHARE = 0.9              # ... and at most this share of (free space + what it holds)


class UnusableDir(Exception):
    """A tier directory the sidecar cannot write (start-up refuses to go on)."""


def check_dirs(config: Config) -> None:
    """Create each tier directory and write, fsync and remove a probe file in it."""
    dirs = [("--data-dir", config.data_dir)] if config.file_tier else []
    if config.hf3fs_dir:
        dirs.append(("--hf3fs-dir", config.hf3fs_dir))
    for flag, path in dirs:
        try:
            _probe(path)
        except OSError as exc:
            fix = " or start with --no-file-tier" if flag == "--data-dir" else ""
            raise UnusableDir(f"{flag} {path} is unusable: {exc.strerror or exc} "
                              f"({type(exc).__name__}); make it a writable directory{fix}") from None


def _probe(path: str) -> None:
    os.makedirs(path, 0o700, exist_ok=True)
    probe = os.path.join(path, f".kv-sidecar-probe.{os.getpid()}")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"probe")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(probe)


def held_bytes(path: str) -> int:
    """Bytes the files under `path` occupy on disk."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def file_tier_size(config: Config) -> tuple[int, str]:
    """The file tier's size: `--file-tier-size`, or min(64 GiB, 90% of (the file system's
    free space + what the tier already holds)). Returns it and how it was chosen."""
    if config.file_tier_size:
        return config.file_tier_size, "--file-tier-size"
    st = os.statvfs(config.data_dir)
    free, held = st.f_bavail * st.f_frsize, held_bytes(config.data_dir)
    size = min(DEFAULT_CAP, int(FREE_SHARE * (free + held)))
    return size, (f"default: min(64 GiB, 90% of {free} bytes free + {held} bytes held)")
