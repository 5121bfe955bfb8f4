"""Fixtures: a real uvicorn server on loopback (in a thread, so tests can check the pool's
invariants on its own loop), and `spawn` to run `python -m sidecar serve` as a process
(loadtest/kit/procs.py's launcher)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import replace

import pytest
import uvicorn

from api.app import create_app
from api.engine.client import SidecarClient
from loadtest.kit.procs import SidecarProcess, free_port, socket_path
from sidecar.config import Config
from sidecar.server import listeners, uvicorn_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Engine suites need the engine's own virtualenv: `make test-sglang` runs tests/engines/sglang
# there (naming the path, which collect_ignore does not block). The project's suite skips them
# and runs tests/engines/adapters (the adapters' own parts, no engine needed).
collect_ignore = ["engines/sglang", "engines/vllm"]

# Every default the sidecar reads from the environment, pointed by `hermetic` at a fresh
# temp dir per test (short: a socket path holds at most 100 bytes). The first four are
# what `Config()` resolves its data dir and socket from; HOME catches `~` anywhere else.
HERMETIC_DIRS = {
    "HOME": "home",
    "XDG_CACHE_HOME": "cache",
    "XDG_CONFIG_HOME": "config",
    "XDG_RUNTIME_DIR": "run",
    "RUNTIME_DIRECTORY": "run/kv-sidecar",
}


@pytest.fixture(autouse=True)
def hermetic(monkeypatch):
    """No test reads or writes the user's `~/.cache/kv-sidecar`, `/run/kv-sidecar` or a
    default socket, or takes a token, URL or setting from the environment it ran in: two
    runs at once, or a run beside `make serve`, never meet. Child processes inherit this."""
    top = tempfile.mkdtemp(prefix="kvh-")
    for var, sub in HERMETIC_DIRS.items():
        path = os.path.join(top, sub)
        os.makedirs(path, 0o700, exist_ok=True)
        monkeypatch.setenv(var, path)
    for var in [v for v in os.environ if v.startswith("SIDECAR_")]:
        monkeypatch.delenv(var)
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def scratch():
    """`tempfile.mkdtemp` (same arguments) whose directories go after the test."""
    made: list[str] = []

    def make(**kw) -> str:
        made.append(tempfile.mkdtemp(**kw))
        return made[-1]

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def _has_cuda() -> bool:
    """Whether a CUDA device is usable. Only "no CUDA here" answers False: our own cuda_ipc
    module must import (a broken import is an error, never a skip), and cuda_available()
    itself answers False when the driver or cuda-python is missing."""
    from sidecar.transports.cuda_ipc import cuda_available

    return cuda_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def engine_connection(server, timeout: float = 10) -> socket.socket:
    """A raw connection to a server's engine socket (requests the client would never send,
    asked as this process's uid: the owner of the namespaces its client made)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(server.config.socket)
    return s


class LiveServer:
    """uvicorn serving `create_app(config)` in a background thread, on loopback TCP and on
    an engine socket, with the same listeners and protocol as `sidecar serve`."""

    def __init__(self, config: Config):
        self.config = config
        self.app = create_app(config)
        self.url = f"http://127.0.0.1:{config.port}"
        self.socket_url = f"unix://{config.socket}"
        self.sockets = listeners(config)
        self.server = uvicorn.Server(uvicorn_config(self.app, replace(config, log_level="warning")))
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        self.server.run(sockets=self.sockets)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("live server did not start")
            time.sleep(0.02)
        return self

    @property
    def ctx(self):
        return self.app.state.ctx

    def on_loop(self, fn):
        """Run `fn()` on the server's event loop (where the index lives) and return its result."""
        fut = asyncio.run_coroutine_threadsafe(_call(fn), self.ctx.loop)
        return fut.result(10)

    def invariants(self) -> None:
        self.on_loop(self.ctx.host_pool.invariants)

    def ns(self, name: str):
        """The namespace called `name`, whoever owns it (as the operator sees it)."""
        from sidecar.tenancy import OPERATOR

        store = self.ctx.store
        return store.namespace(store.resolve(name, OPERATOR))

    def client(self, **kw) -> SidecarClient:
        """A client on the engine socket (what engines use; it can register memory)."""
        return SidecarClient(self.socket_url, token=self.config.token, **kw)

    def tcp_client(self, **kw) -> SidecarClient:
        """A client on loopback TCP (operators and tools; no memory registration)."""
        return SidecarClient(self.url, token=self.config.token, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        for sock in self.sockets:
            sock.close()


async def _call(fn):
    return fn()


@pytest.fixture
def make_server():
    servers = []

    def make(**overrides) -> LiveServer:
        base = Config(
            port=free_port(),
            host_pool=64 * 2**20,
            segment_size=2**20,
            file_tier=False,
            copy_threads=2,
            socket=socket_path(),
        )
        srv = LiveServer(replace(base, **overrides)).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.stop()


@pytest.fixture
def server(make_server) -> LiveServer:
    return make_server()


@pytest.fixture
def client(server) -> SidecarClient:
    c = server.client()
    yield c
    c.close()


@pytest.fixture
def spawn():
    procs = []

    def make(
        *args: str, env: dict | None = None, port: int | None = None, socket: str | None = None
    ) -> SidecarProcess:
        p = SidecarProcess(*args, env=env, port=port, socket=socket)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.kill()


class Gate:
    """Holds every call of `obj.name` until `open()`; `entered` is set once one waits.
    `patch` sets the wrapper (pass `monkeypatch.setattr` to patch a class and undo it)."""

    def __init__(self, obj, name: str, patch=setattr):
        self.real = getattr(obj, name)
        self.entered, self.released = threading.Event(), threading.Event()
        # a plain function: patched on a class it binds `self` like the method it replaces
        patch(obj, name, lambda *args, **kwargs: self._held(*args, **kwargs))

    def _held(self, *args, **kwargs):
        self.entered.set()
        assert self.released.wait(30), "the test never opened the gate"
        return self.real(*args, **kwargs)

    def open(self):
        self.released.set()


def replay_frames(endpoint: str) -> list[tuple[bytes, bytes, bytes]]:
    """Ask a KV events replay socket (sidecar/events.py) for every batch it keeps, from
    seq 0: [(topic, seq, payload)], up to its end marker."""
    import zmq  # the `events` extra

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    out = []
    while True:
        assert sock.poll(10_000)
        _, topic, seq, payload = sock.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        out.append((topic, seq, payload))
    sock.close(linger=0)
    return out


def wait_for(cond, timeout: float = 30.0) -> None:
    """Poll `cond` (state another process or thread owns) until true or `timeout`."""
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


@pytest.fixture
def cluster():
    """A real Mooncake cluster on loopback: mooncake_master and one store node."""
    from loadtest.kit.mooncake_cluster import Master, StoreNode

    master = Master().start()
    node = StoreNode(master, "64MB").start()
    yield master, node
    node.kill()
    master.kill()
