"""`sidecar pin|unpin|evict|warm|pins`: the operators' controls (docs/api-additions.md,
"Operator controls") from a shell, over the sidecar's TCP with the token.

    sidecar pin kv KEY...  [--chain [--from K]] [--ttl S]   pin (a chain: its leading run)
    sidecar unpin kv KEY... | --all                         end pins
    sidecar evict kv KEY...  [--chain --from K]             delete from every tier
    sidecar warm kv KEY...   [--chain [--from K]] [--no-wait]  promote, with a progress bar
    sidecar pins [kv]                                       list

Keys come as arguments or `--keys-file F` (one a line, `-`: stdin). More than 4,096 go in
batches of 4,096 (a chain's next batch only while the last one was whole). The token comes
from `--token-file`, else SIDECAR_TOKEN. Prints the answers as JSON; exit 1 on an error
answer, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO

from api.cli.progress import Progress
from api.engine.client import SidecarClient, SidecarError

BATCH = 4096
VERBS = ("pin", "unpin", "evict", "warm", "pins")


def add_parsers(sub: Any) -> None:
    """The five subcommands, on the `sidecar` CLI's subparsers."""
    for verb in VERBS:
        p = sub.add_parser(verb, help=f"{verb} pages of a namespace (operator controls)")
        p.add_argument("namespace", nargs="?" if verb == "pins" else None)
        if verb != "pins":
            p.add_argument("keys", nargs="*", help="page keys (or --keys-file)")
            p.add_argument("--keys-file", help="keys one a line; '-' reads stdin")
            p.add_argument(
                "--chain",
                action="store_true",
                help="the keys are a chain in order: act from --from on",
            )
            p.add_argument("--from", dest="start", help="the chain's first key to act on")
        if verb == "pin":
            p.add_argument("--ttl", type=float, default=3600.0, help="seconds (default 3600)")
        if verb == "unpin":
            p.add_argument("--all", action="store_true", help="every pin of the namespace")
        if verb == "warm":
            p.add_argument("--no-wait", action="store_true", help="start the job and return")
        p.add_argument("--url", default=os.environ.get("SIDECAR_URL", "http://127.0.0.1:8411"))
        p.add_argument("--token-file", help="the operator's token (default: $SIDECAR_TOKEN)")


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        with open(args.token_file) as f:
            return f.read().strip()
    return os.environ.get("SIDECAR_TOKEN") or None


def _keys(args: argparse.Namespace, stdin: TextIO) -> list[str]:
    keys = list(args.keys)
    if args.keys_file:
        if args.keys_file == "-":
            keys += [line.strip() for line in stdin if line.strip()]
        else:
            with open(args.keys_file) as src:
                keys += [line.strip() for line in src if line.strip()]
    if args.start is not None:
        if args.start not in keys:
            raise ValueError(f"--from {args.start!r} is not one of the keys")
        keys = keys[keys.index(args.start) :]
    return keys


def _path(ns: str, verb: str) -> str:
    from urllib.parse import quote

    return f"/v1/namespaces/{quote(ns, safe='')}/{verb}"


def _batches(c: SidecarClient, args: argparse.Namespace, keys: list[str]) -> dict[str, Any]:
    """pin, unpin or evict in batches of BATCH keys; the answers' counts summed."""
    total: dict[str, Any] = {}
    bar = Progress(len(keys), args.command)
    for i in range(0, len(keys), BATCH):
        part = keys[i : i + BATCH]
        body: dict[str, Any] = {"chain": part} if args.chain else {"keys": part}
        if args.command == "pin":
            body["ttl"] = args.ttl
        got = c.request("POST", _path(args.namespace, args.command), body)[1]
        for k, v in got.items():
            total[k] = (
                total.get(k, 0) + v
                if k in ("pinned", "missing", "unpinned", "deleted", "failed", "queued_for_tiers")
                else v
            )
        bar.update(len(part))
        if args.chain and args.command == "pin" and got.get("pinned", 0) < len(part):
            break  # the chain's run ended in this batch
    bar.close()
    return total


def _warm(c: SidecarClient, args: argparse.Namespace, keys: list[str]) -> dict[str, Any]:
    """Start a warm job a batch; unless --no-wait, follow them with a progress bar."""
    jobs = []
    for i in range(0, len(keys), BATCH):
        part = keys[i : i + BATCH]
        job = c.request(
            "POST", _path(args.namespace, "warm"), {"chain": part} if args.chain else {"keys": part}
        )[1]
        jobs.append(job)
        if args.chain and job["pages"] < len(part):
            break
    if args.no_wait:
        return {"jobs": jobs}
    bar = Progress(sum(j["pages"] for j in jobs), "warm")
    states = []
    for job in jobs:
        seen = 0
        while True:
            st = c.request("GET", f"/v1/warm/{job['job']}")[1]
            bar.update(st["done"] - seen)
            seen = st["done"]
            if st["state"] != "running":
                break
            time.sleep(0.1)  # polling a job another process runs: the only way to wait
        states.append(st)
    bar.close()
    return {
        "jobs": states,
        "pages": sum(s["pages"] for s in states),
        "loaded": sum(s["loaded"] for s in states),
        "failed": [s for s in states if s["state"] == "failed"],
    }


def run(args: argparse.Namespace, stdin: TextIO = sys.stdin) -> dict[str, Any]:
    c = SidecarClient(args.url, token=_token(args), timeout=120)
    try:
        if args.command == "pins":
            if args.namespace is None:
                return c.request("GET", "/v1/pins")[1]
            return c.request("GET", _path(args.namespace, "pins"))[1]
        if args.command == "unpin" and args.all:
            return c.request("POST", _path(args.namespace, "unpin"), {"all": True})[1]
        keys = _keys(args, stdin)
        if not keys:
            raise ValueError("name at least one key (arguments or --keys-file)")
        return _warm(c, args, keys) if args.command == "warm" else _batches(c, args, keys)
    finally:
        c.close()


def cli(args: argparse.Namespace) -> int:
    try:
        out = run(args)
    except ValueError as exc:
        print(f"sidecar {args.command}: {exc}", file=sys.stderr)
        return 2
    except (SidecarError, OSError) as exc:
        print(f"sidecar {args.command}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 1 if out.get("failed") else 0
