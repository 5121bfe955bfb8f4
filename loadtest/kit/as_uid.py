"""The as-uid runner: a function in a forked child as another uid (red-team attackers and
victims, engine calls from other uids), and the DaemonSet's sidecar as another uid (the
interpreter under /root is not executable by other uids, so no exec)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from api.engine.client import SidecarClient
from loadtest.kit.procs import free_port

NOBODY = 65534


def as_user(
    fn: Callable[..., Any],
    *args: Any,
    uid: int = NOBODY,
    groups: Sequence[int] = (),
    timeout: float = 120,
) -> Any:
    """`fn(*args)` in a forked child as `uid` (gid the same) with supplementary `groups`;
    its result, or RuntimeError with the child's error (never a hang: `timeout`)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            os.setgroups(list(groups))
            os.setgid(uid)
            os.setuid(uid)
            q.put(("ok", fn(*args)))
        except BaseException as exc:  # report, never hang the parent
            q.put(("error", repr(exc)))

    p = ctx.Process(target=child, daemon=True)
    p.start()
    kind, value = q.get(timeout=timeout)
    p.join(timeout)
    if kind == "error":
        raise RuntimeError(f"the child as uid {uid} failed: {value}")
    return value


class Sidecar:
    """`sidecar serve ARGS` as `uid`:`gid` with the container's paths mapped to the node's
    (`paths`: mount path -> directory), on 127.0.0.1 and a small host pool."""

    def __init__(self, args: list[str], paths: dict[str, str], uid: int, gid: int, token: str):
        self.port, self.token = free_port(), token
        self.args = [self._local(a, paths) for a in args]
        self.socket = next(a.split("=", 1)[1] for a in self.args if a.startswith("--socket="))
        self.uid, self.gid = uid, gid
        self.out = tempfile.TemporaryFile()  # noqa: SIM115 (the forked sidecar writes it until it exits)
        self.pid, self.returncode = 0, None

    def _local(self, arg: str, paths: dict[str, str]) -> str:
        name, _, value = arg.partition("=")
        if name == "--host":
            return "--host=127.0.0.1"
        if name == "--port":
            return f"--port={self.port}"
        if name == "--host-pool":
            return "--host-pool=64MiB"
        for mount, local in paths.items():
            if value == mount or value.startswith(mount + "/"):
                return f"{name}={local}{value[len(mount) :]}"
        return arg

    def reference_modules(self) -> list[str]:
        """The modules a root `sidecar serve` of these args imports by the time it exits,
        having served the engine calls below: the child imports them before it drops root,
        as a uid that cannot read this interpreter's library under /root could not later."""
        with tempfile.TemporaryDirectory() as d:
            out, port = os.path.join(d, "modules"), free_port()
            args = [
                a for a in self.args if not a.startswith(("--port=", "--socket=", "--data-dir="))
            ]
            args += [f"--port={port}", f"--socket={d}/s.sock", f"--data-dir={d}/data"]
            code = (
                f"import atexit, sys; atexit.register(lambda: open({out!r}, 'w').write("
                f"' '.join(sys.modules))); from sidecar.cli import main; sys.exit(main({args!r}))"
            )
            proc = subprocess.Popen(
                [sys.executable, "-c", code],
                env={**os.environ, "SIDECAR_TOKEN": self.token},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                ref = Sidecar.__new__(Sidecar)
                ref.socket, ref.token = f"{d}/s.sock", self.token
                client = SidecarClient(f"http://127.0.0.1:{port}", token=self.token, timeout=2)
                deadline = time.time() + 60
                while not self._ready(client):
                    assert time.time() < deadline and proc.poll() is None, (
                        "the reference sidecar did not start"
                    )
                    time.sleep(0.05)
                ref.engine_put(self.token)
            finally:
                proc.terminate()
                proc.wait(30)
            with open(out) as f:
                return f.read().split()

    def __enter__(self) -> Sidecar:
        modules = self.reference_modules()
        self.pid = os.fork()
        if self.pid == 0:  # the child: drop to the pod's user, then the CLI
            code = 1
            try:
                os.dup2(self.out.fileno(), 1)
                os.dup2(self.out.fileno(), 2)
                sys.stdout = sys.stderr = open(2, "w", buffering=1, closefd=False)  # not pytest's
                logging.root.handlers.clear()  # (pytest's capture: serve's basicConfig then logs here)
                for name in modules:
                    with contextlib.suppress(Exception):  # (__main__ and the like)
                        importlib.import_module(name)
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
                os.environ["SIDECAR_TOKEN"] = self.token
                from sidecar.cli import main

                code = main(self.args)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        client, deadline = (
            SidecarClient(f"http://127.0.0.1:{self.port}", token=self.token, timeout=2),
            time.time() + 60,
        )
        while not self._ready(client):
            assert time.time() < deadline and self._alive(), (
                f"the sidecar did not start ({self.returncode}): {self.log()}"
            )
            time.sleep(0.05)
        return self

    def _ready(self, client: SidecarClient) -> bool:
        try:
            return client.ready()
        except OSError:
            return False

    def _alive(self) -> bool:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)
        return pid == 0

    def __exit__(self, *exc) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGTERM)
            deadline = time.time() + 30
            while self._alive() and time.time() < deadline:
                time.sleep(0.05)
            if self.returncode is None:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)

    def log(self) -> str:
        self.out.seek(0)
        return self.out.read().decode(errors="replace")[-3000:]

    def engine_put(self, token: str | None) -> bytes:
        """An engine's calls on the engine socket: a namespace, a page set, the page got."""
        c = SidecarClient(f"unix://{self.socket}", token=token)
        c.put_namespace("kv", 4096, model="m")
        assert c.put_page("kv", "k", b"p" * 4096)
        return c.get_page("kv", "k")

    def engine_connect(self) -> str:
        """What connecting to the engine socket gives: "connected" or the error's name."""
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(self.socket)
            except OSError as exc:
                return type(exc).__name__
        return "connected"
