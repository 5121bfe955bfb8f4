import os

import pytest

from sidecar.errors import BadRequest, GeometryMismatch, InvalidKey, PayloadTooLarge
from sidecar.keys import check_keys
from sidecar.spec import parse_spec
from sidecar.transports import cuda_ipc
from sidecar.transports.base import Chunk, coalesce, page_runs, parse_chunks
from sidecar.transports.shm import ShmMapping


def test_chunks_validated_against_page_and_buffer():
    ok = parse_chunks([{"offset": 0, "stride": 8, "size": 4}, {"offset": 4, "stride": 8, "size": 4}], 8, 64, 8)
    assert ok == (Chunk(0, 8, 4), Chunk(4, 8, 4))
    with pytest.raises(GeometryMismatch):
        parse_chunks([{"offset": 0, "stride": 8, "size": 4}], 8, 64, 8)       # sums to 4, not 8
    with pytest.raises(GeometryMismatch):
        parse_chunks([{"offset": 8, "stride": 8, "size": 8}], 8, 64, 8)       # last slot ends at 72
    with pytest.raises(BadRequest):
        parse_chunks([{"offset": -1, "stride": 8, "size": 8}], 8, 64, 8)
    with pytest.raises(BadRequest):
        parse_chunks([], 8, 64, 8)


def test_page_runs_and_coalesce():
    chunks = (Chunk(0, 16, 8), Chunk(8, 16, 8))  # two halves of a 16-byte slot: contiguous
    runs = list(page_runs(chunks, [1000], 2))
    assert runs == [(1032, 0, 8), (1040, 8, 8)]
    plan = [(5000 + off, addr, n) for addr, off, n in runs]
    assert coalesce(plan) == [(5000, 1032, 16)]
    assert coalesce([(0, 100, 4), (8, 104, 4)]) == [(0, 100, 4), (8, 104, 4)]


def test_keys_checked_in_one_pass_and_individually():
    assert check_keys(["a" * 128, "0-9._:A"]) == ["a" * 128, "0-9._:A"]
    for bad in (["a\nb"], ["é"], [""], ["a" * 129], [None], "abc"):
        with pytest.raises((InvalidKey, BadRequest)):
            check_keys(bad)
    with pytest.raises(PayloadTooLarge):
        check_keys(["a"] * 4097)


def test_spec_identity_is_stable_and_scoped():
    a = parse_spec({"page_bytes": 64, "model": "m", "rank": {"tp": 1, "tp_size": 2}})
    b = parse_spec({"rank": {"tp_size": 2, "tp": 1}, "model": "m", "page_bytes": 64,
                    "host_capacity_bytes": 640})
    assert a.identity() == b.identity() and len(a.identity()) == 32
    other_rank = parse_spec({"page_bytes": 64, "model": "m", "rank": {"tp": 0, "tp_size": 2}})
    assert other_rank.identity() != a.identity()
    rep0 = parse_spec({"page_bytes": 64, "replicated": True, "rank": {"tp": 0, "tp_size": 2}})
    rep1 = parse_spec({"page_bytes": 64, "replicated": True, "rank": {"tp": 1, "tp_size": 2}})
    assert rep0.identity() == rep1.identity()


def test_shm_mapping_refuses_paths_outside_allowed_dirs(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(BadRequest):
        ShmMapping(str(f), None, None, 64, ["/dev/shm"])
    link = f"/dev/shm/kv-sidecar-link-{os.getpid()}"
    os.symlink(str(f), link)
    try:
        with pytest.raises(BadRequest):  # a link out of /dev/shm is resolved and refused
            ShmMapping(link, None, None, 64, ["/dev/shm"])
    finally:
        os.unlink(link)
    m = ShmMapping(str(f), None, None, 64, [str(tmp_path)])
    assert m.size == 64
    with pytest.raises(GeometryMismatch):
        ShmMapping(str(f), None, None, 65, [str(tmp_path)])
    m.close()


def test_cuda_ipc_validation_without_a_gpu():
    with pytest.raises(BadRequest):
        cuda_ipc.parse_handle({"handle": "ab" * 63, "device_uuid": "GPU-" + "0" * 8})
    handle, offset, uuid = cuda_ipc.parse_handle(
        {"handle": "AB" * 64, "offset": 4096, "device_uuid": "GPU-12345678-1234-1234-1234-123456789abc"})
    assert len(handle) == 64 and offset == 4096
    assert cuda_ipc.register_host_memory(0, 0) in (False, True)  # never raises


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
