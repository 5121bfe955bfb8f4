"""The chaos soak's second tenant: an engine of another uid, in a process of its own.

    python -m loadtest.chaos.tenant --url unix:///S --ns wt-t2 --seed N --page-bytes B \\
        --t0 T [--uid 65534] [--share-gid 0] [--slots 8] [--think 0.05]

It drops to `--uid` (keeping `--share-gid` as its one supplementary group), makes its
namespace shared with that group (so the soak's checks, as root, reach it: `share_gid`),
lends a memfd and sets a batch of pages every `--think` seconds, re-registering after a
restart, until its stdin closes. Every set is two JSON lines on stdout, on the
soak's clock (`time.monotonic() - t0`), which the soak applies to its ledger:

    {"ev": "start", "keys": [...], "t": 1.23}
    {"ev": "done", "keys": [...], "stored": [true, ...] | null, "start": 1.23, "t": 1.25}

A page's bytes are the ledger's (`ledger.payload`), so the soak checks what it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time

from api.engine.client import SidecarClient, SidecarError, SidecarUnavailable
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.chaos.ledger import payload


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def stdin_closed() -> bool:
    ready, _, _ = select.select([sys.stdin], [], [], 0)
    return bool(ready) and not sys.stdin.read(1)


class Tenant:
    def __init__(self, args):
        self.args, self.client = args, SidecarClient(args.url, timeout=30)
        self.buf = SharedBuffer(args.slots * args.page_bytes, name="chaos-tenant")
        self.bid = None
        self.serial = 0

    def now(self) -> float:
        return time.monotonic() - self.args.t0

    def setup(self) -> bool:
        a = self.args
        try:
            self.client.put_namespace(
                a.ns, a.page_bytes, model="chaos", page_tokens=16, share_gid=a.share_gid
            )
            self.bid = self.buf.register(
                self.client, a.ns, a.slots, page_first_chunks(a.page_bytes)
            )
            return True
        except (SidecarUnavailable, SidecarError, OSError):
            self.client.close_leases()
            time.sleep(0.2)
            return False

    def one_set(self) -> None:
        a, pb = self.args, self.args.page_bytes
        self.serial += 1
        keys = [f"t2-{self.serial}-{i}" for i in range(a.slots)]
        for slot, key in enumerate(keys):
            self.buf.view(slot * pb, pb)[:] = payload(a.seed, a.ns, key, pb)
        start = self.now()
        emit(ev="start", keys=keys, t=start)
        try:
            stored = self.client.set(a.ns, keys, self.bid, list(range(a.slots)))
        except SidecarUnavailable:
            stored, self.bid = None, None
        except SidecarError as exc:
            stored = None
            if exc.status == 404:
                self.bid = None  # the sidecar restarted: register again
        emit(ev="done", keys=keys, stored=stored, start=start, t=self.now())

    def run(self) -> None:
        while not stdin_closed():
            if self.bid is None and not self.setup():
                continue
            self.one_set()
            time.sleep(self.args.think)


def drop_to(uid: int, group: int) -> None:
    if os.geteuid() == 0 and uid != 0:
        os.setgroups([group])
        os.setgid(uid)
        os.setuid(uid)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--ns", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--page-bytes", type=int, required=True)
    p.add_argument("--t0", type=float, required=True)
    p.add_argument("--uid", type=int, default=os.geteuid())
    p.add_argument("--share-gid", type=int, default=0)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--think", type=float, default=0.05, help="seconds between sets")
    args = p.parse_args(argv)
    drop_to(args.uid, args.share_gid)
    emit(ev="ready", uid=os.geteuid(), groups=sorted(os.getgroups()))
    Tenant(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
