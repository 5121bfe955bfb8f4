"""What an attack module declares (`ATTACKS: list[Attack]`) and what it attacks (`Target`):
the red team's contract, apart from the runner that names the modules."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Target:
    """A running sidecar under attack."""

    url: str  # http://127.0.0.1:PORT
    socket: str  # engine socket path (its fd socket is socket + ".fds")
    token: str | None
    pid: int
    workdir: str  # a temp dir the attack may use (world-writable, sticky)

    @property
    def socket_url(self) -> str:
        return f"unix://{self.socket}"


@dataclass
class Attack:
    item: int  # issue 26 item
    name: str
    run: Callable[[Target, threading.Event], dict]
    seconds: float = 5.0
    sidecar_args: tuple = ()  # extra flags for its sidecar
    token: str | None = "redteam-token"  # the sidecar's token (None: none)
    rss_limit_mib: float = 128.0  # growth of the sidecar's RSS allowed
    prepare: Callable[[str], None] | None = None  # makes files in the sidecar's dir first
    setup: Callable[[Target], dict] | None = None  # builds state before /healthz is timed


def rss_mib(pid: int) -> float | None:
    """The resident set of `pid` in MiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
