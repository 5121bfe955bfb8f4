"""cuda_ipc on a CPU machine: validation and clean refusals (the GPU paths are in
tests/api/test_cuda_ipc_gpu.py, marked `gpu`)."""

import pytest
import torch

from sidecar.errors import BadRequest, GeometryMismatch, TransportUnavailable
from sidecar.transports import cuda_ipc
from sidecar.transports.base import parse_chunks

UUID = "GPU-12345678-1234-1234-1234-123456789abc"


def test_regions_single_handle_form_and_list():
    one = cuda_ipc.parse_regions({"handle": "ab" * 64, "device_uuid": UUID, "offset": 8}, 4096)
    assert one == [(bytes.fromhex("ab" * 64), 8, UUID.lower(), 4096)]
    many = cuda_ipc.parse_regions(
        {
            "regions": [
                {"handle": "cd" * 64, "device_uuid": UUID, "size": 64},
                {"handle": "ef" * 64, "device_uuid": UUID, "size": 128, "offset": 0},
            ]
        },
        1,
    )
    assert [r[3] for r in many] == [64, 128]


@pytest.mark.parametrize(
    "body",
    [
        {"handle": "zz" * 64, "device_uuid": UUID},
        {"handle": "ab" * 63, "device_uuid": UUID},
        {"handle": "ab" * 64, "device_uuid": "GPU-1"},
        {"handle": "ab" * 64, "device_uuid": UUID, "offset": -1},
        {"regions": []},
        {"regions": [{"handle": "ab" * 64, "device_uuid": UUID}]},
        {"regions": "x"},
    ],
)
def test_bad_handles_are_400(body):
    with pytest.raises(BadRequest):
        cuda_ipc.parse_regions(body, 64)


def test_chunks_are_checked_per_region():
    ok = parse_chunks(
        [
            {"offset": 0, "stride": 8, "size": 8, "region": 0},
            {"offset": 0, "stride": 8, "size": 8, "region": 1},
        ],
        16,
        [64, 64],
        8,
    )
    assert [c.region for c in ok] == [0, 1]
    with pytest.raises(BadRequest):
        parse_chunks([{"offset": 0, "stride": 8, "size": 16, "region": 2}], 16, [64, 64], 8)
    with pytest.raises(GeometryMismatch):
        parse_chunks([{"offset": 0, "stride": 16, "size": 16, "region": 1}], 16, [256, 64], 8)


@pytest.mark.skipif(cuda_ipc.cuda_available(), reason="a GPU is present")
def test_without_a_gpu_registration_is_unavailable_not_500():
    assert cuda_ipc.CudaIpc.create() is None
    with pytest.raises(TransportUnavailable):
        cuda_ipc.open_buffer({"handle": "ab" * 64, "device_uuid": UUID}, None, 1, 64)
    assert cuda_ipc.register_host_memory(0, 4096) is False


def test_engine_export_refuses_cpu_tensors():
    from api.engine.cuda_export import cuda_regions_and_chunks

    with pytest.raises((ValueError, RuntimeError)):
        cuda_regions_and_chunks([torch.zeros(4, 8)])
