import ctypes
import os

import pytest

from sidecar.errors import BadRequest, GeometryMismatch, InvalidKey, PayloadTooLarge
from sidecar.keys import check_keys
from sidecar.spec import parse_spec
from sidecar.transports import cuda_ipc
from sidecar.transports.base import Chunk, CopyFailed, build_plan, parse_chunks
from sidecar.transports.shm import ShmMapping, open_beneath


def test_chunks_validated_against_page_and_buffer():
    ok = parse_chunks(
        [{"offset": 0, "stride": 8, "size": 4}, {"offset": 4, "stride": 8, "size": 4}], 8, 64, 8
    )
    assert ok == (Chunk(0, 8, 8),)  # the halves touch in every slot: one run
    with pytest.raises(GeometryMismatch):
        parse_chunks([{"offset": 0, "stride": 8, "size": 4}], 8, 64, 8)  # sums to 4, not 8
    with pytest.raises(GeometryMismatch):
        parse_chunks([{"offset": 8, "stride": 8, "size": 8}], 8, 64, 8)  # last slot ends at 72
    with pytest.raises(BadRequest):
        parse_chunks([{"offset": -1, "stride": 8, "size": 8}], 8, 64, 8)
    with pytest.raises(BadRequest):
        parse_chunks([], 8, 64, 8)


def test_plan_addresses_each_chunk_and_merges_only_runs_touching_on_both_sides():
    chunks = (Chunk(0, 16, 8), Chunk(8, 16, 8))  # two halves of a 16-byte slot: contiguous
    assert build_plan(chunks, [1000], [(5000, 2)], into_engine=False) == [(5000, 1032, 16)]
    assert build_plan(chunks, [1000], [(5000, 2)], into_engine=True) == [(1032, 5000, 16)]
    apart = (Chunk(0, 16, 4), Chunk(8, 16, 4))  # the engine's halves do not touch
    assert build_plan(apart, [100], [(0, 0)], into_engine=True) == [(100, 0, 4), (108, 4, 4)]


def test_keys_checked_in_one_pass_and_individually():
    assert check_keys(["a" * 128, "0-9._:A"]) == ["a" * 128, "0-9._:A"]
    for bad in (["a\nb"], ["é"], [""], ["a" * 129], [None], "abc"):
        with pytest.raises((InvalidKey, BadRequest)):
            check_keys(bad)
    with pytest.raises(PayloadTooLarge):
        check_keys(["a"] * 4097)


def test_spec_identity_is_stable_and_scoped():
    a = parse_spec({"page_bytes": 512, "model": "m", "rank": {"tp": 1, "tp_size": 2}})
    b = parse_spec(
        {
            "rank": {"tp_size": 2, "tp": 1},
            "model": "m",
            "page_bytes": 512,
            "host_capacity_bytes": 640,
        }
    )
    assert (
        a.identity("ns", "operator") == b.identity("ns", "operator")
        and len(a.identity("ns", "operator")) == 32
    )
    other_rank = parse_spec({"page_bytes": 512, "model": "m", "rank": {"tp": 0, "tp_size": 2}})
    assert other_rank.identity("ns", "operator") != a.identity("ns", "operator")
    rep0 = parse_spec({"page_bytes": 512, "replicated": True, "rank": {"tp": 0, "tp_size": 2}})
    rep1 = parse_spec({"page_bytes": 512, "replicated": True, "rank": {"tp": 1, "tp_size": 2}})
    assert rep0.identity("ns", "operator") == rep1.identity("ns", "operator")
    # the owner is part of it: equal names and specs of two tenants never share tier pages
    assert len({a.identity("ns", o) for o in ("operator", "uid:1000", "uid:1001", "gid:7")}) == 4


def test_open_beneath_never_leaves_the_allowed_dirs(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"\0" * 64)
    for bad in (str(f), "relative", "/dev/shm/../etc/passwd", "/dev/shm//x", "/dev/shm/a\0b"):
        with pytest.raises(BadRequest):
            open_beneath(bad, ["/dev/shm"])
    link = f"/dev/shm/kv-sidecar-link-{os.getpid()}"
    os.symlink(str(tmp_path), link)
    try:
        with pytest.raises(BadRequest):  # a link anywhere on the way is not followed
            open_beneath(f"{link}/x", ["/dev/shm"])
    finally:
        os.unlink(link)
    m = ShmMapping(open_beneath(str(f), [str(tmp_path)]), 64)
    assert m.size == 64 and not m.sealed and m.addresses == [0]  # a plain file: fd mode
    m.close()
    with pytest.raises(GeometryMismatch):
        ShmMapping(open_beneath(str(f), [str(tmp_path)]), 65)


def test_sealable_memfd_is_mapped_and_truncation_is_a_clean_failure():
    sealable = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    os.ftruncate(sealable, 4096)
    m = ShmMapping(os.dup(sealable), 4096)
    assert m.sealed and m.addresses[0] != 0
    with pytest.raises(PermissionError):
        os.ftruncate(sealable, 0)
    m.close()
    plain = os.memfd_create("u", 0)
    os.ftruncate(plain, 8192)
    m = ShmMapping(os.dup(plain), 8192)
    dst = bytearray(4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    assert m.run_plan([(addr, 4096, 4096)], into_engine=False) == 4096
    os.ftruncate(plain, 1000)
    with pytest.raises(CopyFailed):
        m.run_plan([(addr, 0, 4096)], into_engine=False)
    m.close()


def test_cuda_ipc_validation_without_a_gpu():
    with pytest.raises(BadRequest):
        cuda_ipc.parse_handle({"handle": "ab" * 63, "device_uuid": "GPU-" + "0" * 8})
    handle, offset, uuid = cuda_ipc.parse_handle(
        {
            "handle": "AB" * 64,
            "offset": 4096,
            "device_uuid": "GPU-12345678-1234-1234-1234-123456789abc",
        }
    )
    assert len(handle) == 64 and offset == 4096
    # never raises: no device answers False without a CUDA call, and with one a null range
    # is refused by cudaHostRegister
    assert cuda_ipc.register_host_memory(0, 0) is False


def test_split_plan_keeps_every_byte_once():
    from sidecar.transports.base import split_plan

    plan = [(0, 10_000, 5 << 20), (5 << 20, 20_000_000, 7 << 20)]
    parts = split_plan(plan, 2)
    assert len(parts) == 2
    sizes = [sum(n for _, _, n in p) for p in parts]
    assert sum(sizes) == 12 << 20 and abs(sizes[0] - sizes[1]) <= 1
    flat = sorted(run for p in parts for run in p)
    pos = 0
    for dst, src, n in flat:  # contiguous, in order, no overlap, sources follow destinations
        assert dst == pos
        assert src - dst in (10_000, 20_000_000 - (5 << 20))
        pos += n
    assert split_plan(plan, 1) == [plan]
    assert split_plan([(0, 0, 100)], 4) == [[(0, 0, 100)]]


def test_write_sealed_memfd_is_copied_through_the_fd():
    import fcntl

    fd = os.memfd_create("ws", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    m = ShmMapping(os.dup(fd), 4096)
    assert not m.sealed and m.addresses == [0]
    src = ctypes.create_string_buffer(4096)
    with pytest.raises(CopyFailed):  # writes into it fail cleanly (EPERM), never a crash
        m.run_plan([(0, ctypes.addressof(src), 4096)], into_engine=True)
    m.close()


def test_adjacent_chunks_merge_and_runs_are_bounded():
    from sidecar.transports.base import MAX_RUNS, check_runs

    # K/V halves that touch in every slot become one run; a gap or another stride does not
    raw = [
        {"offset": 0, "stride": 16, "size": 4},
        {"offset": 4, "stride": 16, "size": 4},
        {"offset": 12, "stride": 16, "size": 4},
        {"offset": 64, "stride": 8, "size": 4},
    ]
    assert parse_chunks(raw, 16, 128, 4) == (Chunk(0, 16, 8), Chunk(12, 16, 4), Chunk(64, 8, 4))
    many = [{"offset": i, "stride": 4096, "size": 1} for i in range(4096)]
    assert parse_chunks(many, 4096, 4096 * 2, 2) == (Chunk(0, 4096, 4096),)
    check_runs(MAX_RUNS, 1)
    with pytest.raises(PayloadTooLarge):
        check_runs(1024, 4096)


def test_fd_socket_pauses_instead_of_spinning_when_out_of_fds(tmp_path, monkeypatch):
    """accept() failing with EMFILE leaves the socket readable: the server must stop
    watching it for a while rather than call accept() in a busy loop."""
    import asyncio
    import errno
    import socket as so

    from sidecar import leases

    monkeypatch.setattr(leases, "ACCEPT_PAUSE", 0.2)
    path = str(tmp_path / "f.sock")
    listener = so.socket(so.AF_UNIX, so.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()

    class NoFds:  # the listener, whose accept() fails as when the process is out of fds
        calls = 0

        def fileno(self):
            return listener.fileno()

        def setblocking(self, flag):
            listener.setblocking(flag)

        def accept(self):
            NoFds.calls += 1
            raise OSError(errno.EMFILE, "Too many open files")

        def close(self):
            listener.close()

    async def run():
        server = leases.LendServer(leases.LeaseRegistry(), NoFds(), path)
        server.start(asyncio.get_running_loop())
        client = so.socket(so.AF_UNIX, so.SOCK_SEQPACKET)
        client.connect(path)  # pending: the listener is readable from now on
        await asyncio.sleep(0.1)
        paused = NoFds.calls
        await asyncio.sleep(0.25)  # past the pause: it tries again, once or so
        client.close()
        server.close()
        return paused, NoFds.calls

    paused, later = asyncio.run(run())
    assert paused == 1 and 2 <= later <= 4
