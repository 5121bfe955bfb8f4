"""Configuration: defaults < TOML file (`--config`) < `SIDECAR_<NAME>` environment < flags."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

WRITE_POLICIES = ("write_through", "write_back", "none")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """`1GiB`, `512MiB`, `2g`, `4096` -> bytes. Raises ValueError on anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    m = _SIZE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 4096, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def _default_data_dir() -> str:
    """`$XDG_CACHE_HOME/kv-sidecar`, else `~/.cache/kv-sidecar`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kv-sidecar")


def _default_socket() -> str:
    """The engine socket: in `$RUNTIME_DIRECTORY` when set (systemd's RuntimeDirectory=,
    and what the test suite points at a temp dir), else /run/kv-sidecar for root (and
    containers), else the user's runtime directory, else beside the data directory."""
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        return os.path.join(runtime, "sidecar.sock")
    if os.geteuid() == 0:
        return "/run/kv-sidecar/sidecar.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime or _default_data_dir(), "kv-sidecar.sock")


# KV events (sidecar/publisher.py `Limits`): a subscriber's queue is at least EVENTS_MIN_HWM
# batches (below it ZMQ, which learns of reads in steps, dropped batches for a subscriber
# that read each at once); a replay client's is EVENTS_REPLAY_HWM
EVENTS_MIN_HWM, EVENTS_REPLAY_HWM = 32, 16


@dataclass(frozen=True, slots=True)
class Config:
    """Everything the process is started with. Sizes are bytes."""

    host: str = "127.0.0.1"
    port: int = 8411
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None  # read once at start; beats nothing else (see load)
    # TCP tenants' own tokens, `NAME TOKEN` a line (sidecar/credentials.py): never the operator
    tenant_tokens_file: str | None = None
    socket: str = field(default_factory=_default_socket)  # "" : no engine socket
    socket_mode: int = 0o660  # the engine socket's (and fd socket's) mode
    socket_group: str | None = None  # and group: the engines' users belong to it
    host_pool: int = 2 * 2**30
    segment_size: int = 0  # 0: host_pool / 64, clamped to [1 MiB, 64 MiB]
    data_dir: str = field(default_factory=_default_data_dir)
    file_tier: bool = True
    file_tier_size: int = 0  # 0: min(64 GiB, 90% of free + held), see datadir
    hf3fs_dir: str | None = None
    hf3fs_size: int = 0  # 0: no limit (the cluster's storage is managed elsewhere)
    hf3fs_rescan: float = 30.0  # ignored since the slotted 3FS tier (it tails logs; docs/3fs.md)
    hf3fs_group: str | None = None  # nodes' sidecars share 3FS pages through this group
    mooncake_master: str | None = None  # HOST:PORT of mooncake_master: adds the Mooncake tier
    mooncake_metadata: str = "P2PHANDSHAKE"
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_segment_size: int = 2**30  # memory this node lends the Mooncake cluster
    mooncake_local_hostname: str = ""  # empty: the address that routes to the master
    write_policy: str = "write_through"
    max_body: int = 256 * 2**20  # any request body
    max_json_body: int = 4 * 2**20  # JSON request bodies (the largest allowed is ~2.3 MB)
    shm_dirs: tuple[str, ...] = ("/dev/shm",)
    copy_threads: int = max(4, os.cpu_count() or 1)  # a large move is split over every core
    tier_threads: int = 2
    write_queue_pages: int = 256  # pages pinned for the tiers before a set waits
    shutdown_timeout: float = 30.0
    read_timeout: float = 30.0  # a request head or body stalled this long: closed
    max_connections: int = 1024  # open HTTP connections on each listener (counted apart)
    # connections (issue 26: items 3, 6, 10; sidecar/connections.py)
    max_connections_per_uid: int = 256  # engine socket: one peer uid's connections at most
    auth_timeout: float = 5.0  # TCP with a token: idle or head time before showing it
    body_timeout: float = 60.0  # a request body must be whole this long after its head
    write_timeout: float = 30.0  # answers unread (writing paused) this long: aborted
    max_head: int = 64 * 2**10  # request line + headers (414/431 past it)
    max_header_fields: int = 100  # header fields a request (431 past it)
    # KV events for cache-aware routers (sidecar/events.py); off unless an endpoint is given
    kv_events: str | None = None  # ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557
    kv_events_replay: str | None = None  # ZMQ ROUTER replay endpoint (default: PUB port + 1)
    kv_events_format: str = "map"  # "map" (vLLM's tagged structs) or "array" (positional)
    kv_events_topic: str = ""  # topic prefix (default kv-sidecar@<hostname>)
    kv_events_buffer: int = 10_000  # batches kept for replay
    kv_events_buffer_bytes: int = 256 * 2**20  # and their bytes at most (a mapping, resident)
    kv_events_gather: float = 0.02  # s a batch gathers events before it is sent
    kv_events_hwm: int = 1000  # batches queued to a subscriber at most, then dropped for it
    kv_events_batch_bytes: int = 256 * 2**10  # bytes of one batch at most (events split to fit)
    kv_events_queue_bytes: int = 64 * 2**20  # bytes queued to every subscriber and replay
    # client together, at most: a subscriber's hwm is what this holds for max subscribers
    kv_events_max_subscribers: int = 4  # connections each event socket takes at once
    kv_events_mode: int = 0o600  # ipc:// event sockets' mode (this user only)
    kv_events_group: str | None = None  # and their group (the routers' users are in it)
    kv_events_token_ids: bool = False  # publish each page's token ids (its prompt): opt in
    # lent memory (issue 26: items 2, 4, 5, 10; sidecar/leases.py, copier.py, buffers.py)
    copy_deadline: float = 30.0  # s a request waits for its copy; then false, buffer bad
    lend_idle_timeout: float = 5.0  # s an fd socket connection holding no lease may idle
    max_mapped: int = 64 * 2**40  # bytes of engine memory mapped, every uid together
    max_mapped_per_uid: int = 16 * 2**40  # and by one uid's buffers (429 beyond)
    log_level: str = "info"

    @property
    def tcp_guarded(self) -> bool:
        """Whether TCP asks for a credential (the operator's token or a tenant's)."""
        return self.token is not None or self.tenant_tokens_file is not None

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.host_pool < 4096:
            raise ValueError(f"host pool must be at least 4096 bytes, got {self.host_pool}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}"
            )
        if self.copy_threads < 1 or self.tier_threads < 1 or self.write_queue_pages < 1:
            raise ValueError("copy threads, tier threads and write queue pages must be >= 1")
        if self.mooncake_master is not None and not re.fullmatch(
            r"\[?[^\s]+\]?:\d{1,5}", self.mooncake_master
        ):
            raise ValueError(f"mooncake master must be HOST:PORT, got {self.mooncake_master!r}")
        if self.segment_size and not 0 < self.segment_size <= self.host_pool:
            raise ValueError("segment size must be in 1..host pool size")
        if self.socket and (not os.path.isabs(self.socket) or len(self.socket.encode()) > 100):
            raise ValueError(
                f"socket must be an absolute path of at most 100 bytes, got {self.socket!r}"
            )
        self._check_event_endpoints()
        if self.kv_events_format not in ("map", "array"):
            raise ValueError(
                f"kv events format must be map or array, got {self.kv_events_format!r}"
            )
        if min(self.kv_events_buffer, self.kv_events_buffer_bytes) < 0:
            raise ValueError("kv events buffer and buffer bytes must be >= 0")
        if self.kv_events_hwm < 32:  # ZMQ learns of a subscriber's reads in steps: below
            # this it dropped batches for one that kept up (docs/kv-events.md, Limits)
            raise ValueError(f"kv events hwm must be >= 32 batches, got {self.kv_events_hwm!r}")
        if (
            self.kv_events_batch_bytes < 64 * 2**10
            or self.kv_events_queue_bytes < self.kv_events_batch_bytes
        ):
            raise ValueError(
                "kv events batch bytes must be >= 64KiB and queue bytes >= batch bytes"
            )
        self._check_event_queues()
        if not 0 <= self.kv_events_mode <= 0o777:
            raise ValueError(
                f"kv events mode must be an octal mode like 0660, got {self.kv_events_mode:o}"
            )
        if not 0 < self.kv_events_gather <= 1:
            raise ValueError(
                f"kv events gather must be in (0, 1] seconds, got {self.kv_events_gather!r}"
            )
        if not 0 <= self.socket_mode <= 0o777:
            raise ValueError(
                f"socket mode must be an octal mode like 0660, got {self.socket_mode:o}"
            )
        if (
            min(
                self.max_connections,
                self.max_connections_per_uid,
                self.max_head,
                self.max_header_fields,
            )
            < 1
        ):
            raise ValueError("connection caps, max head and max header fields must be >= 1")
        if min(self.read_timeout, self.auth_timeout, self.body_timeout, self.write_timeout) <= 0:
            raise ValueError("read, auth, body and write timeouts must be > 0 seconds")
        if (
            min(self.copy_deadline, self.lend_idle_timeout) <= 0
            or min(self.max_mapped, self.max_mapped_per_uid) < 1
        ):
            raise ValueError(
                "copy deadline and lend idle timeout must be > 0 s, mapped bounds >= 1 byte"
            )

    def _check_event_queues(self) -> None:
        """With events on, `--kv-events-queue-bytes` holds, for each of
        `--kv-events-max-subscribers` subscribers and as many replay clients, their queues
        of batches of `--kv-events-batch-bytes` (sidecar/publisher.py, `Limits`), a
        subscriber's 32 at least."""
        if self.kv_events_max_subscribers < 1:
            raise ValueError(
                f"kv events max subscribers must be >= 1, got {self.kv_events_max_subscribers}"
            )
        if not self.kv_events:
            return
        # (sidecar/publisher.py `Limits.sndhwm`: what is left of a place's share of the
        # budget beside a replay client's queue and one batch in flight for each)
        place = self.kv_events_queue_bytes // (
            self.kv_events_max_subscribers * self.kv_events_batch_bytes
        )
        if min(self.kv_events_hwm, place - (EVENTS_REPLAY_HWM + 1) - 1) < EVENTS_MIN_HWM:
            each = EVENTS_MIN_HWM + 1 + EVENTS_REPLAY_HWM + 1
            raise ValueError(
                f"kv events queue bytes must hold {each} batches of batch bytes for each of "
                f"the {self.kv_events_max_subscribers} max subscribers: at least "
                f"{each * self.kv_events_max_subscribers * self.kv_events_batch_bytes}, "
                f"got {self.kv_events_queue_bytes}"
            )

    def _check_event_endpoints(self) -> None:
        """An `ipc://` endpoint is a socket file the sidecar makes with the engine socket's
        mode and group: an absolute path (an abstract `@name` has no permissions, any
        user may bind it first), and the PUB's and the replay socket's differ."""
        for endpoint in (self.kv_events, self.kv_events_replay):
            if endpoint and endpoint.startswith("ipc://") and not os.path.isabs(endpoint[6:]):
                raise ValueError(
                    f"an ipc:// kv events endpoint must be an absolute path, got {endpoint!r}"
                )
        if self.kv_events and self.kv_events == self.kv_events_replay:
            raise ValueError("the kv events PUB and replay endpoints must differ")

    @property
    def effective_segment_size(self) -> int:
        if self.segment_size:
            return self.segment_size
        size = min(max(self.host_pool // 64, 2**20), 64 * 2**20, self.host_pool)
        return max(size // 4096 * 4096, 4096)


_SIZES = {
    "host_pool",
    "segment_size",
    "file_tier_size",
    "hf3fs_size",
    "max_body",
    "max_json_body",
    "mooncake_segment_size",
    "max_head",
    "max_mapped",
    "max_mapped_per_uid",
    "kv_events_buffer_bytes",
    "kv_events_batch_bytes",
    "kv_events_queue_bytes",
}
_BOOLS = {"file_tier", "kv_events_token_ids"}
_INTS = {
    "port",
    "copy_threads",
    "tier_threads",
    "write_queue_pages",
    "max_connections",
    "kv_events_buffer",
    "kv_events_hwm",
    "kv_events_max_subscribers",
    "max_connections_per_uid",
    "max_header_fields",
}
_FLOATS = {
    "shutdown_timeout",
    "hf3fs_rescan",
    "read_timeout",
    "auth_timeout",
    "body_timeout",
    "write_timeout",
    "copy_deadline",
    "lend_idle_timeout",
    "kv_events_gather",
}
_OPTIONAL = (
    "token",
    "token_file",
    "hf3fs_dir",
    "socket_group",
    "hf3fs_group",
    "mooncake_master",
    "kv_events",
    "kv_events_replay",
    "kv_events_group",
)


def coerce(name: str, value: Any) -> Any:
    """Turn a TOML, environment or flag value into the field's type."""
    if name in _SIZES:
        return parse_size(value)
    if name in _BOOLS:
        return parse_bool(value)
    if name in _INTS:
        return int(value)
    if name in _FLOATS:
        return float(value)
    if name in ("socket_mode", "kv_events_mode"):
        return value if isinstance(value, int) else int(str(value), 8)
    if name == "shm_dirs":
        return (
            tuple(value)
            if isinstance(value, (list, tuple))
            else tuple(p for p in str(value).split(":") if p)
        )
    return None if value in (None, "") and name in _OPTIONAL else value


def field_names() -> list[str]:
    return [f.name for f in fields(Config)]


def load(
    file: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build a Config from a TOML file, the environment and explicit overrides, in that order."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if file:
        data = tomllib.loads(Path(file).read_text())
        unknown = set(data) - set(field_names())
        if unknown:
            raise ValueError(f"unknown keys in {file}: {sorted(unknown)}")
        values.update(data)
    for name in field_names():
        raw = env.get("SIDECAR_" + name.upper())
        if raw is not None:
            values[name] = raw
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    config = replace(Config(), **{k: coerce(k, v) for k, v in values.items()})
    return _with_token_file(config)


def _with_token_file(config: Config) -> Config:
    """Read `token_file` (a secret kept out of `ps` and the environment)."""
    if not config.token_file:
        return config
    if config.token:
        raise ValueError("give the token once: --token / SIDECAR_TOKEN or --token-file")
    token = Path(config.token_file).read_text().strip()
    if not token:
        raise ValueError(f"token file {config.token_file} is empty")
    return replace(config, token=token)
