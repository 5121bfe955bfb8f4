"""Start the sidecar and the bare baseline as separate processes on loopback ports."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from api.engine.client import SidecarClient, SidecarError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_GIVEN: set[int] = set()  # ports free_port handed out, in this process


def free_port() -> int:
    """A port free now and not handed out before by this process: the kernel may give a
    released port again at once, and a server started on the last one may not have bound
    it yet (a benchmark's replay socket and its sidecar's HTTP port got the same one)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


class Proc:
    """A child server process; `url` once it answers /healthz."""

    def __init__(self, cmd: list[str], port: int, socket_path: str | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.socket_url = f"unix://{socket_path}" if socket_path else None
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        client, deadline = SidecarClient(self.url, timeout=2), time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd} exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if client.ready():
                    return
            except SidecarError as exc:  # behind a token (the red-team runner): up, answering 401
                if exc.status != 401:
                    raise
                return
            time.sleep(0.05)
        raise RuntimeError(f"{cmd} did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@functools.cache
def _socket_dir() -> str:
    """This process's directory of socket paths, made on first use and removed at its exit;
    others may pass through it (each socket's own directory is 0700)."""
    top = tempfile.mkdtemp(prefix="kvs-")
    os.chmod(top, 0o755)
    atexit.register(shutil.rmtree, top, True)
    return top


def socket_path() -> str:
    """A fresh engine socket path (short: sun_path holds 108 bytes), in `_socket_dir`
    (a test run starts hundreds of sidecars: none leaves a directory behind)."""
    return os.path.join(tempfile.mkdtemp(dir=_socket_dir()), "s.sock")


def start_sidecar(*args: str) -> Proc:
    """`sidecar serve` on a free port and its own engine socket (`Proc.socket_url`)."""
    port, sock = free_port(), socket_path()
    return Proc(
        [
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--port",
            str(port),
            "--socket",
            sock,
            "--log-level",
            "warning",
            *args,
        ],
        port,
        sock,
    )


def start_bare() -> Proc:
    """The bare baseline (loadtest/bare_app.py) on a free port and a Unix socket."""
    port, sock = free_port(), socket_path()
    code = f"from loadtest.bare_app import serve; serve({port}, {sock!r})"
    return Proc([sys.executable, "-c", code], port, sock)
