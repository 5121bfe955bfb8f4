"""`sidecar serve` (and `python -m sidecar serve`): the server's flags and its start.

The `sidecar` command's other subcommands (replay, plan, the operator controls) are clients
of the API and live above the sidecar, in `api/cli/`, which builds on this parser.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from sidecar import __version__
from sidecar.config import load

_FLAGS = [
    ("--host", "host", "bind address (default 127.0.0.1)"),
    ("--port", "port", "TCP port (default 8411)"),
    (
        "--token",
        "token",
        "the operator's token: loopback TCP requires 'Authorization: Bearer TOKEN' on "
        "every request but /healthz; the engine socket never takes it (visible in ps: "
        "prefer --token-file or SIDECAR_TOKEN)",
    ),
    ("--token-file", "token_file", "read the operator's token from this file"),
    (
        "--tenant-tokens",
        "tenant_tokens_file",
        "a private file of `NAME TOKEN` lines: TCP callers with a tenant's token act as "
        "that tenant (its own namespaces only), never as the operator",
    ),
    (
        "--socket",
        "socket",
        "engine socket path (default /run/kv-sidecar/sidecar.sock as root, "
        "else $XDG_RUNTIME_DIR/kv-sidecar.sock); '' turns it off",
    ),
    ("--socket-mode", "socket_mode", "engine socket mode, octal (default 0660)"),
    ("--socket-group", "socket_group", "engine socket group (the engines' users are in it)"),
    ("--host-pool", "host_pool", "host pool size, units allowed: 512MiB, 4GiB (default 2GiB)"),
    ("--segment-size", "segment_size", "arena segment size (default host pool / 64, 1-64 MiB)"),
    ("--data-dir", "data_dir", "local file tier directory (default ~/.cache/kv-sidecar)"),
    (
        "--file-tier-size",
        "file_tier_size",
        "local file tier size limit (default: 90%% of the "
        "free space plus what the tier holds, at most 64GiB)",
    ),
    ("--hf3fs-dir", "hf3fs_dir", "3FS mount directory for the shared tier (off by default)"),
    (
        "--hf3fs-size",
        "hf3fs_size",
        "size limit of this node's view of the 3FS tier (default: none)",
    ),
    (
        "--hf3fs-group",
        "hf3fs_group",
        "group of the 3FS pages (files 0640, dirs 2770); default: this user only (0600 / 0700)",
    ),
    (
        "--hf3fs-rescan",
        "hf3fs_rescan",
        "accepted, ignored: the 3FS tier tails the other nodes' logs every 0.1 s (docs/3fs.md)",
    ),
    (
        "--mooncake-master",
        "mooncake_master",
        "HOST:PORT of a mooncake_master: adds the Mooncake tier",
    ),
    (
        "--mooncake-metadata",
        "mooncake_metadata",
        "Mooncake metadata: P2PHANDSHAKE (default), etcd://, http://",
    ),
    (
        "--mooncake-protocol",
        "mooncake_protocol",
        "Mooncake transfer protocol: tcp (default) or rdma",
    ),
    ("--mooncake-device", "mooncake_device", "RDMA device names for Mooncake, e.g. mlx5_0,mlx5_1"),
    (
        "--mooncake-segment-size",
        "mooncake_segment_size",
        "memory lent to the Mooncake cluster (1GiB)",
    ),
    (
        "--mooncake-local-hostname",
        "mooncake_local_hostname",
        "address other Mooncake nodes reach this one at (default: the one routing to the master)",
    ),
    ("--write-policy", "write_policy", "write_through (default), write_back or none"),
    ("--max-body", "max_body", "largest request body (default 256MiB)"),
    ("--copy-threads", "copy_threads", "copy worker threads (default: the cores, at least 4)"),
    ("--tier-threads", "tier_threads", "tier writer threads (default 2)"),
    (
        "--write-queue-pages",
        "write_queue_pages",
        "pages queued for the tiers before set waits (256)",
    ),
    ("--shutdown-timeout", "shutdown_timeout", "seconds to drain on SIGTERM (default 30)"),
    ("--read-timeout", "read_timeout", "seconds a request head or body may stall (default 30)"),
    (
        "--max-connections",
        "max_connections",
        "open HTTP connections on each listener, counted apart (1024)",
    ),
    # connections (issue 26): per uid, before the token, heads, body deadline, unread answers
    (
        "--max-connections-per-uid",
        "max_connections_per_uid",
        "engine socket connections of one peer uid at most (default 256)",
    ),
    (
        "--auth-timeout",
        "auth_timeout",
        "seconds a TCP connection may stay idle or send its head "
        "before showing the token, when one is set (default 5)",
    ),
    ("--body-timeout", "body_timeout", "seconds a request body may take in all (default 60)"),
    (
        "--write-timeout",
        "write_timeout",
        "seconds an answer may wait for the client to read (default 30)",
    ),
    ("--max-head", "max_head", "largest request line + headers (default 64KiB)"),
    ("--max-header-fields", "max_header_fields", "header fields a request at most (default 100)"),
    (
        "--kv-events",
        "kv_events",
        "publish KV events on this ZMQ endpoint, e.g. tcp://127.0.0.1:5557 "
        "(off by default; docs/kv-events.md)",
    ),
    (
        "--kv-events-replay",
        "kv_events_replay",
        "ZMQ replay (ROUTER) endpoint (default: the PUB port + 1)",
    ),
    (
        "--kv-events-format",
        "kv_events_format",
        "map (vLLM's tagged structs, default) or array (positional)",
    ),
    ("--kv-events-topic", "kv_events_topic", "topic prefix (default kv-sidecar@<hostname>)"),
    ("--kv-events-buffer", "kv_events_buffer", "event batches kept for replay (10000)"),
    (
        "--kv-events-buffer-bytes",
        "kv_events_buffer_bytes",
        "bytes of event batches kept for replay at most: resident from the start (256MiB)",
    ),
    (
        "--kv-events-gather",
        "kv_events_gather",
        "seconds a batch gathers events before it is sent (default 0.02)",
    ),
    (
        "--kv-events-hwm",
        "kv_events_hwm",
        "batches queued to a subscriber that does not read, then "
        "dropped for it (1000; fewer where --kv-events-queue-bytes says)",
    ),
    (
        "--kv-events-batch-bytes",
        "kv_events_batch_bytes",
        "bytes of one event batch at most (256KiB)",
    ),
    (
        "--kv-events-queue-bytes",
        "kv_events_queue_bytes",
        "bytes of batches queued to every subscriber and replay client together, "
        "at most (64MiB): a subscriber's hwm is what it holds for max subscribers",
    ),
    (
        "--kv-events-max-subscribers",
        "kv_events_max_subscribers",
        "connections each event socket (PUB, replay) takes at once; "
        "past it refused at the handshake (4)",
    ),
    (
        "--kv-events-mode",
        "kv_events_mode",
        "mode of ipc:// event sockets, octal (default 0600: this user)",
    ),
    (
        "--kv-events-group",
        "kv_events_group",
        "group of ipc:// event sockets (the routers' users are in it)",
    ),
    # lent memory (issue 26): stuck copies, idle lenders, address space
    (
        "--copy-deadline",
        "copy_deadline",
        "seconds a set/get waits for its copy; past it its pages "
        "answer false and the buffer is marked bad (default 30)",
    ),
    (
        "--lend-idle-timeout",
        "lend_idle_timeout",
        "seconds an fd socket connection holding no lease may stay idle (default 5)",
    ),
    ("--max-mapped", "max_mapped", "engine memory mapped at once, every user (default 64TiB)"),
    (
        "--max-mapped-per-uid",
        "max_mapped_per_uid",
        "engine memory one user's buffers may map (16TiB)",
    ),
    ("--log-level", "log_level", "debug, info, warning, error"),
]


def parser() -> argparse.ArgumentParser:
    return commands()[0]


def commands() -> tuple[argparse.ArgumentParser, Any]:
    """The `sidecar` parser with its `serve` command, and its subparsers (for `api.cli` to
    add the clients' commands to)."""
    p = argparse.ArgumentParser(
        prog="sidecar", description="kv-sidecar: a per-node KV-cache sidecar"
    )
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the sidecar")
    serve.add_argument("--config", help="TOML file with any of the keys below (snake_case)")
    for flag, dest, text in _FLAGS:
        serve.add_argument(flag, dest=dest, help=text)
    serve.add_argument(
        "--no-file-tier",
        dest="file_tier",
        action="store_const",
        const=False,
        help="keep pages in the host pool only",
    )
    serve.add_argument(
        "--kv-events-token-ids",
        dest="kv_events_token_ids",
        action="store_const",
        const=True,
        help="publish each page's token ids (its prompt) in KV events: "
        "every subscriber reads them (off: block hashes only)",
    )
    serve.add_argument(
        "--shm-dir",
        dest="shm_dirs",
        action="append",
        help="directory engines may register shm files from (repeatable; default /dev/shm)",
    )
    return p, sub


def run_serve(args: argparse.Namespace) -> int:
    """Start the sidecar from parsed `serve` arguments; its exit code."""
    from sidecar.server import serve

    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        config = load(args.config, overrides=overrides)
    except (ValueError, OSError) as exc:
        print(f"sidecar: bad configuration: {exc}", file=sys.stderr)
        return 2
    return serve(config)


def main(argv: Sequence[str] | None = None) -> int:
    """`serve` alone (what the engine-side tests embed); `python -m sidecar` and the `sidecar`
    command run the whole CLI, `api.cli.main`."""
    return run_serve(parser().parse_args(argv))
