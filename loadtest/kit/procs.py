"""Child server processes on loopback ports: the one sidecar launcher (`SidecarProcess`,
variants by subclass), the bare baseline, free ports and engine socket paths."""

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
from typing import IO, Any, Self

from api.engine.client import SidecarClient, SidecarError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    """A child server process on a loopback `port` (and an engine `socket`), run from the
    checkout's root; its stdout and stderr go to `log` (a temporary file unless given: a
    pipe nobody reads could block the server). `wait_ready` before use."""

    def __init__(
        self,
        cmd: list[str],
        port: int,
        socket: str | None = None,
        env: dict[str, str] | None = None,
        log: IO[bytes] | None = None,
    ):
        self.port, self.socket = port, socket
        self.url = f"http://127.0.0.1:{port}"
        self.socket_url = f"unix://{socket}" if socket else None
        self.log = log if log is not None else tempfile.TemporaryFile()  # noqa: SIM115 (written until exit)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=full_env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def output(self) -> str:
        """What the process wrote so far (its log from the start)."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def wait_ready(self, token: str | None = None, timeout: float = 60) -> Self:
        """Poll /readyz until it answers (a 401 behind a token not given is up too)."""
        client, deadline = SidecarClient(self.url, token=token, timeout=2), time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode}: {self.output()[-2000:]}")
            try:
                if client.ready():
                    return self
            except SidecarError as exc:
                if exc.status != 401:
                    raise
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.proc.args} did not become ready")

    def terminate(self, timeout: float = 30) -> tuple[int, str]:
        """SIGTERM, wait; its exit status and output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=timeout)
        return self.proc.returncode, self.output()

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, killed after `timeout`; its exit status (-9 when killed)."""
        try:
            return self.terminate(timeout)[0]
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


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


class SidecarProcess(Proc):
    """`python -m sidecar serve ARGS` on a free loopback port (or `port`) and its own engine
    socket (or `socket`). The one launcher: a variant names another entry point (`module`,
    which must end in the sidecar's CLI) or environment by subclassing."""

    module = "sidecar"

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        port: int | None = None,
        socket: str | None = None,
        log: IO[bytes] | None = None,
    ):
        port, socket = port or free_port(), socket or socket_path()
        cmd = [sys.executable, "-m", self.module, "serve", "--port", str(port)]
        super().__init__([*cmd, "--socket", socket, *args], port, socket, env, log)


class SlowTierSidecar(SidecarProcess):
    """The sidecar whose file tier reads each page `delay_ms` late: a fault injected on
    purpose (loadtest/kit/vllm/slow_tier.py), for "never slower than recomputing"."""

    module = "loadtest.kit.vllm.slow_tier"

    def __init__(self, *args: str, delay_ms: float, **kw: Any):
        env = dict(kw.pop("env", None) or {}, KV_SIDECAR_TEST_READ_DELAY_MS=str(delay_ms))
        super().__init__(*args, env=env, **kw)


def start_sidecar(*args: str) -> SidecarProcess:
    """`sidecar serve ARGS` at log level warning, ready (`socket_url`: its engine socket)."""
    return SidecarProcess("--log-level", "warning", *args).wait_ready()


def start_bare() -> Proc:
    """The bare baseline (loadtest/micro/bare_app.py) on a free port and a Unix socket."""
    port, sock = free_port(), socket_path()
    code = f"from loadtest.micro.bare_app import serve; serve({port}, {sock!r})"
    return Proc([sys.executable, "-c", code], port, sock).wait_ready()
