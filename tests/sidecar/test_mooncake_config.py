"""The Mooncake flags: flag, SIDECAR_* environment and TOML key, like every other."""

import pytest

from sidecar.cli import parser
from sidecar.config import load
from sidecar.context import build_tiers


def test_mooncake_flags_env_and_toml(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(
        'mooncake_master = "10.0.0.1:50051"\nmooncake_segment_size = "2GiB"\n'
        'mooncake_protocol = "rdma"\n'
    )
    c = load(
        str(toml),
        env={"SIDECAR_MOONCAKE_DEVICE": "mlx5_0", "SIDECAR_MOONCAKE_METADATA": "etcd://e:2379"},
    )
    assert (c.mooncake_master, c.mooncake_segment_size, c.mooncake_protocol) == (
        "10.0.0.1:50051",
        2 * 2**30,
        "rdma",
    )
    assert (c.mooncake_device, c.mooncake_metadata) == ("mlx5_0", "etcd://e:2379")
    args = parser().parse_args(
        [
            "serve",
            "--mooncake-master",
            "h:1",
            "--mooncake-segment-size",
            "0",
            "--mooncake-local-hostname",
            "10.1.1.1",
        ]
    )
    c = load(
        None,
        env={},
        overrides={k: v for k, v in vars(args).items() if k not in ("command", "config")},
    )
    assert (c.mooncake_master, c.mooncake_segment_size, c.mooncake_local_hostname) == (
        "h:1",
        0,
        "10.1.1.1",
    )
    assert [t.name for t in build_tiers(c)][-1] == "mooncake"
    assert load(None, env={}).mooncake_master is None
    assert "mooncake" not in [t.name for t in build_tiers(load(None, env={}))]


@pytest.mark.parametrize("bad", ["nohost", "h:", ":50051", "h:port"])
def test_a_bad_master_address_is_a_configuration_error(bad):
    with pytest.raises(ValueError, match="HOST:PORT"):
        load(None, env={"SIDECAR_MOONCAKE_MASTER": bad})
