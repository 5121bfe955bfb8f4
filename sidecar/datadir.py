"""Start-up checks of the tier directories, and the file tier's default size.

An unusable data directory (not creatable, not writable, a file in the way, a read-only
mount) stops the sidecar at start: one error line naming the directory and the fix, exit
status 1. Serving without the tier would answer `durable` sets and restarts differently
from what the operator configured; `--no-file-tier` is the explicit way to run without it.

So does a directory someone else could have prepared (squatted): the data dir, the 3FS
dir and the engine socket's dir must be real directories (not symlinks) owned by the
sidecar's user or root and writable by no other user, and so must every directory above
them, unless it has the sticky bit (/tmp). Otherwise a user who made the directory first
could swap in the socket, or plant links the sidecar would write through
(`check_private`). A 3FS dir shared through `--hf3fs-group` may be writable by that group.
"""

from __future__ import annotations

import os
import stat

from sidecar.config import Config

DEFAULT_CAP = 64 * 2**30  # the file tier's default size is at most this
FREE_SHARE = 0.9  # ... and at most this share of (free space + what it holds)


class UnusableDir(Exception):
    """A tier directory the sidecar cannot write (start-up refuses to go on)."""


def check_dirs(config: Config) -> None:
    """Create each tier directory, check that nobody else controls it, and write, fsync
    and remove a probe file in it."""
    dirs: list[tuple[str, str, str | None]] = (
        [("--data-dir", config.data_dir, None)] if config.file_tier else []
    )
    if config.hf3fs_dir:
        dirs.append(("--hf3fs-dir", config.hf3fs_dir, config.hf3fs_group))
    for flag, path, group in dirs:
        fix = " or start with --no-file-tier" if flag == "--data-dir" else ""
        try:
            _probe(path)
        except OSError as exc:
            raise UnusableDir(
                f"{flag} {path} is unusable: {exc.strerror or exc} "
                f"({type(exc).__name__}); make it a writable directory{fix}"
            ) from None
        why = check_private(path, group_writable=group is not None)
        if why:
            raise UnusableDir(f"{flag} {path} is unusable: {why}{fix}")


def check_private(path: str, group_writable: bool = False) -> str | None:
    """Why another user could control the directory `path` (None: nobody can). `path`
    must be a real directory of this user or root, writable by no other user (nor its
    group, unless `group_writable`); each directory above it too, or sticky."""
    me = os.geteuid()
    path = os.path.abspath(path)
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{exc.strerror} (cannot be inspected)"
    if not stat.S_ISDIR(st.st_mode):
        return "it is a symlink or not a directory; give a real directory"
    others = 0o002 if group_writable else 0o022
    if st.st_uid not in (me, 0) or st.st_mode & others:
        return (
            f"it is owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}: another user "
            f"could have made it first or can change it; make it this user's (or root's) "
            f"and writable by no one else"
        )
    parent = os.path.dirname(path)
    while parent != path:
        st = os.stat(parent)
        if st.st_uid not in (me, 0) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            return (
                f"{parent} above it is owned by uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):o}: another user could swap the directory"
            )
        path, parent = parent, os.path.dirname(parent)
    return None


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


def held_bytes(path: str, enough: int | None = None) -> int:
    """Bytes the files under `path` occupy on disk (counting stops at `enough`)."""
    total = 0
    if enough is not None and enough <= 0:
        return 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
            if enough is not None and total >= enough:
                return total
    return total


def _existing(path: str) -> str:
    """`path`, or its nearest existing ancestor (the file system it will be made on)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def file_tier_size(config: Config, held: int | None = None) -> tuple[int, str]:
    """The file tier's size: `--file-tier-size`, or min(64 GiB, 90% of (the file system's
    free space + what the tier already holds)). `held`: the bytes the tier's recovery found
    (the sidecar sizes the tier then: no second walk); None: counted here by a walk. Returns
    the size and how it was chosen."""
    if config.file_tier_size:
        return config.file_tier_size, "--file-tier-size"
    st = os.statvfs(_existing(config.data_dir))
    free = st.f_bavail * st.f_frsize
    # past this much held the size is DEFAULT_CAP whatever else is there: a large disk
    # (most NVMe) reads no file at all (a walk of 1,000,000 page files takes seconds)
    enough = max(0, int(DEFAULT_CAP / FREE_SHARE) - free)  # held bytes that reach the cap
    if held is None:
        held = held_bytes(config.data_dir, enough)
    size = min(DEFAULT_CAP, int(FREE_SHARE * (free + held)))
    told = f"{held} bytes held" if held < enough else "what the tier holds"
    return size, (f"default: min(64 GiB, 90% of {free} bytes free + {told})")
