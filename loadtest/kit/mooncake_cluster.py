"""A real Mooncake cluster on loopback for tests and benchmarks: `mooncake_master` and a
store node (`mooncake_client` lending a segment), on free ports, restartable in place."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from loadtest.kit.procs import free_port


def binary(name: str) -> str | None:
    """The wheel's console script next to this interpreter, else one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


def available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return binary("mooncake_master") is not None and binary("mooncake_client") is not None


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")


class _Child:
    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (the child process writes it until it exits)

    def _spawn(self, cmd: list[str]) -> subprocess.Popen:
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
        )
        return self.proc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()


class Master(_Child):
    """`mooncake_master` on 127.0.0.1:<port>; `restart` keeps the port (its objects are lost)."""

    def __init__(self, port: int | None = None, lease_ms: int | None = None):
        super().__init__()
        self.port, self.metrics_port, self.lease_ms = port or free_port(), free_port(), lease_ms
        self.address = f"127.0.0.1:{self.port}"

    def start(self) -> Master:
        lease = [] if self.lease_ms is None else [f"--default_kv_lease_ttl={self.lease_ms}"]
        self._spawn(
            [
                binary("mooncake_master"),
                f"--rpc_port={self.port}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                "--rpc_thread_num=2",
                *lease,
            ]
        )
        _wait_port(self.port, self.proc, "mooncake_master")
        return self

    def restart(self) -> Master:
        self.kill()
        return self.start()


class StoreNode(_Child):
    """A `mooncake_client` lending `segment` bytes to the cluster (where pages live)."""

    def __init__(self, master: Master, segment: str = "256MB"):
        super().__init__()
        self.master, self.segment, self.port = master, segment, free_port()

    def start(self) -> StoreNode:
        self._spawn(
            [
                binary("mooncake_client"),
                "--host=127.0.0.1",
                f"--port={self.port}",
                f"--global_segment_size={self.segment}",
                "--local_buffer_size=0",
                f"--master_server_address={self.master.address}",
                "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp",
            ]
        )
        _wait_port(self.port, self.proc, "mooncake_client")
        return self
