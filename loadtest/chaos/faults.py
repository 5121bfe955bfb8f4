"""The chaos soak's moving parts: sidecar processes restarted in place, a small filesystem
that can really fill up, and uploads that stall half way.

    workdir/
      tier/            tmpfs of --disk-size (root), or a plain directory (capped mode)
        wt/ wb/        each sidecar's --data-dir (its file tier)
        filler         the disk-fill fault's file, taking every free byte while it lasts
      wt.log wb.log    each sidecar's stderr, all incarnations
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import tempfile

from loadtest.chaos.ledger import Node
from loadtest.kit.procs import SidecarProcess, free_port


class NodeSidecar:
    """One node's sidecar: same port, engine socket, data dir and log across restarts, each
    incarnation a `SidecarProcess`."""

    def __init__(self, node: Node, data_dir: str, log_path: str, extra: list[str]):
        self.node, self.data_dir, self.extra = node, data_dir, extra
        self.port = free_port()
        self.sock = os.path.join(tempfile.mkdtemp(prefix="kvc-"), "s.sock")
        os.chmod(os.path.dirname(self.sock), 0o755)  # the second tenant (another uid) connects
        self.log = open(log_path, "a+b")  # noqa: SIM115 (each incarnation of the sidecar writes it)
        self.proc: SidecarProcess | None = None
        self.incarnations = 0

    @property
    def url(self) -> str:
        return f"unix://{self.sock}"

    @property
    def tcp(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = ["--log-level", "warning", "--data-dir", self.data_dir]
        args += ["--write-policy", self.node.policy, *self.extra]
        self.log.write(f"--- start {self.incarnations}\n".encode())
        self.log.flush()
        self.proc = SidecarProcess(*args, port=self.port, socket=self.sock, log=self.log)
        self.proc.wait_ready()
        self.incarnations += 1
        self.node.restarted()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def terminate(self, timeout: float = 90) -> int:
        """SIGTERM and wait; the exit status (-9 when it had to be killed)."""
        assert self.proc is not None
        return self.proc.stop(timeout)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # (an exited one is left as it is)
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.sock)


class Disk:
    """The file tiers' filesystem: a tmpfs of `size` bytes when this is root (the fill is a
    real ENOSPC), else a plain directory where the fill cannot reach the tier (capped)."""

    def __init__(self, root: str, size: int):
        self.root, self.size, self.mounted = root, size, False
        os.makedirs(root, exist_ok=True)
        if os.geteuid() == 0:
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", root],
                capture_output=True,
                text=True,
            )
            self.mounted = r.returncode == 0
            self.why = "" if self.mounted else r.stderr.strip()
        else:
            self.why = "not root"
        self.mode = "tmpfs" if self.mounted else f"capped ({self.why}: no real ENOSPC)"
        self.filler = os.path.join(root, "filler")

    def free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def fill(self) -> int:
        """Take every free byte (tmpfs) or a token file (capped); bytes taken."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        taken, chunk = 0, bytes(1 << 20)
        try:
            if not self.mounted:
                return os.write(fd, chunk)
            while True:
                try:
                    taken += os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(chunk) <= 4096:
                        return taken
                    chunk = chunk[: len(chunk) // 4]
        finally:
            os.close(fd)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.filler)

    def temps(self) -> list[str]:
        """Temporary page files left anywhere under the tiers."""
        out = []
        for d, _, files in os.walk(self.root):
            out += [os.path.join(d, f) for f in files if ".tmp" in f]  # either naming
        return out

    def close(self) -> None:
        self.release()
        if self.mounted:
            subprocess.run(["umount", self.root], check=False)
            self.mounted = False


def stall_uploads(path: str, ns: str, keys: list[str], pages: list[bytes]) -> list[socket.socket]:
    """Open one connection per key on the engine socket at `path` (as the namespace's
    owner) and send a PUT's head and half its body, then stall."""
    socks = []
    for key, page in zip(keys, pages, strict=True):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(path)
        head = (
            f"PUT /v1/namespaces/{ns}/pages/{key} HTTP/1.1\r\nHost: chaos\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(page)}\r\n\r\n"
        )
        s.sendall(head.encode() + page[: len(page) // 2])
        socks.append(s)
    return socks
