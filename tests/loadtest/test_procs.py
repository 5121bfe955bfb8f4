"""loadtest.procs: what the benchmarks and tests start their servers with."""

from __future__ import annotations

import socket

from loadtest import procs


class _Kernel:
    """A socket whose bind(0) gets the ports in `ports`, in order: the kernel handing a
    released port out again at once (a fault injected on purpose)."""

    def __init__(self, ports: list[int]):
        self.ports = ports

    def __call__(self, *args):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, addr):
        self.port = self.ports.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    monkeypatch.setattr(procs, "_GIVEN", set())
    monkeypatch.setattr(procs.socket, "socket", _Kernel([41000, 41000, 41000, 41001]))
    assert [procs.free_port(), procs.free_port()] == [41000, 41001]


def test_free_port_is_free_and_new_each_time():
    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    with socket.socket() as s:  # free: it binds
        s.bind(("127.0.0.1", ports[-1]))
