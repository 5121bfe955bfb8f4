import pytest

from sidecar.config import Config, load, parse_size


@pytest.mark.parametrize(
    "text,value",
    [
        ("4096", 4096),
        (4096, 4096),
        ("1GiB", 2**30),
        ("512MiB", 512 * 2**20),
        ("2g", 2 * 10**9),
        ("1.5KiB", 1536),
        ("64 kb", 64000),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "1XB", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_precedence_file_env_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('port = 9000\nhost_pool = "1GiB"\nwrite_policy = "none"\n')
    cfg = load(
        str(f),
        env={"SIDECAR_PORT": "9100", "SIDECAR_FILE_TIER": "0"},
        overrides={"port": "9200", "host": None},
    )
    assert (cfg.port, cfg.host_pool, cfg.write_policy, cfg.file_tier) == (
        9200,
        2**30,
        "none",
        False,
    )
    assert cfg.host == "127.0.0.1"  # secure default bind


def test_rejects_unknown_file_keys_and_bad_values(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("prot = 1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load(str(f), env={})
    with pytest.raises(ValueError):
        load(None, env={"SIDECAR_PORT": "0"})
    with pytest.raises(ValueError):
        load(None, env={"SIDECAR_WRITE_POLICY": "maybe"})


def test_token_not_in_repr():
    assert "hunter2" not in repr(Config(token="hunter2"))


def test_segment_size_default_is_clamped():
    assert Config(host_pool=2**30).effective_segment_size == 16 * 2**20
    assert Config(host_pool=8 * 2**20).effective_segment_size == 2**20
    assert Config(host_pool=64 * 2**30).effective_segment_size == 64 * 2**20


def test_socket_and_token_file(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    f = tmp_path / "c.toml"
    f.write_text(f'token_file = "{secret}"\nsocket_mode = "0600"\nsocket_group = "0"\n')
    cfg = load(str(f), env={"SIDECAR_SOCKET": "/run/x/s.sock"})
    assert (cfg.token, cfg.socket, cfg.socket_mode, cfg.socket_group) == (
        "s3cret",
        "/run/x/s.sock",
        0o600,
        "0",
    )
    assert load(None, env={"SIDECAR_SOCKET": ""}).socket == ""  # no engine socket
    with pytest.raises(ValueError, match="once"):
        load(str(f), env={"SIDECAR_TOKEN": "other"})
    secret.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load(str(f), env={})
    with pytest.raises(ValueError):
        load(None, env={"SIDECAR_SOCKET": "relative.sock"})


def test_kv_events_gather_replay_bytes_and_hwm():
    cfg = load(
        None,
        env={
            "SIDECAR_KV_EVENTS_GATHER": "0.05",
            "SIDECAR_KV_EVENTS_BUFFER_BYTES": "1MiB",
            "SIDECAR_KV_EVENTS_HWM": "64",
        },
    )
    assert (cfg.kv_events_gather, cfg.kv_events_buffer_bytes, cfg.kv_events_hwm) == (
        0.05,
        2**20,
        64,
    )
    assert (Config().kv_events_gather, Config().kv_events_buffer_bytes) == (0.02, 256 * 2**20)
    assert Config().kv_events_hwm == 1000
    Config(kv_events="ipc:///run/k/e", kv_events_replay="ipc:///run/k/r")  # absolute, apart
    for bad in (
        {"kv_events_gather": 0},
        {"kv_events_gather": 1.5},
        {"kv_events_buffer": -1},
        {"kv_events_buffer_bytes": -1},
        {"kv_events_hwm": 31},
        {"kv_events": "ipc://@kv"},
        {"kv_events": "ipc://*"},
        {"kv_events": "tcp://127.0.0.1:1", "kv_events_replay": "ipc://rel/x"},
        {"kv_events": "ipc:///run/k/e", "kv_events_replay": "ipc:///run/k/e"},
    ):
        with pytest.raises(ValueError):
            Config(**bad)
