"""The `sidecar` command: the operator's side of the HTTP contract.

    sidecar serve ...                 start the sidecar (sidecar/cli.py: its flags, its process)
    sidecar replay TRACE --url URL    replay a trace against a running sidecar (replay.py)
    sidecar plan TRACE --capacities   hit rate against capacity, offline (plan.py, lru_sim.py)
    sidecar pin|unpin|evict|warm|pins the operator controls over TCP with the token (ctl.py)

`serve` is the server's own command and lives with it (`python -m sidecar serve` runs it
alone); the rest are clients of the API, so they live here, above the sidecar: this package
imports `sidecar.cli` for `serve`, never the other way round. `python -m api.cli` is the same
command as the `sidecar` console script.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from api.cli import ctl, plan, replay
from sidecar import cli as server_cli


def parser() -> argparse.ArgumentParser:
    """`sidecar serve`'s parser with the clients' subcommands added."""
    p, sub = server_cli.commands()
    replay.parser(
        sub.add_parser("replay", help="replay a Mooncake-format trace against a running sidecar")
    )
    plan.parser(sub.add_parser("plan", help="hit rate vs capacity for a trace (offline)"))
    ctl.add_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "serve":
        return server_cli.run_serve(args)
    if args.command == "replay":
        replay.print_report(replay.run(args), args.json)
        return 0
    if args.command == "plan":
        return plan.cli(args)
    if args.command in ctl.VERBS:
        return ctl.cli(args)
    return 2
