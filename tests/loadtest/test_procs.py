"""loadtest.kit.procs: what the benchmarks and tests start their servers with."""

from __future__ import annotations

import socket

import pytest

from loadtest.kit import procs


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


def test_a_sidecar_that_cannot_start_says_why():
    p = procs.SidecarProcess("--host-pool", "lots")
    try:
        with pytest.raises(RuntimeError, match="not a size: 'lots'"):  # its output, no timeout
            p.wait_ready(timeout=30)
        assert p.proc.returncode not in (None, 0)
    finally:
        p.kill()


def test_a_variant_is_a_subclass_with_its_entry_point_and_environment(tmp_path):
    """The slowed file tier (a fault on purpose) starts through the same launcher: its own
    module, the delay in its environment, the same readiness and a clean exit."""
    p = procs.SlowTierSidecar("--data-dir", str(tmp_path / "d"), delay_ms=5).wait_ready()
    try:
        assert p.proc.args[1:3] == ["-m", "loadtest.kit.vllm.slow_tier"]
        with open(f"/proc/{p.proc.pid}/environ", "rb") as f:
            assert b"KV_SIDECAR_TEST_READ_DELAY_MS=5" in f.read().split(b"\0")
    finally:
        rc, out = p.terminate()
    assert rc == 0, out
