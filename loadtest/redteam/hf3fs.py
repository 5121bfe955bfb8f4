"""Red-team attack on the shared 3FS directory (issue 55), for `python -m loadtest.redteam.runner`.

The sidecar shares its 3FS dir with group `nogroup` (`--hf3fs-group`: files 0640,
directories 2770); uid `nobody` (in that group) then writes beside its node's files:

    forged_3fs_logs   hundreds of fake node directories, each a log of garbage, and one
                      "node" whose log holds checksummed records forged from the real
                      node's: another node's tag, hashes not of their key, slots that hold
                      other pages; then a read of the real page

Held when the sidecar serves the real page's bytes or a miss (never forged bytes), skips
the damaged and forged records (counted), and stays fast and small (the harness checks).
Planting a whole valid page under a key (a slot with a valid header and checksum) is the
known limit: the group is one trust domain (docs/security.md, docs/3fs.md).
"""

from __future__ import annotations

import hashlib
import os
import threading

from api.engine.client import SidecarClient
from loadtest.kit.as_uid import NOBODY, as_user
from loadtest.redteam.attack import Attack, Target
from sidecar.tiers import hf3fs_log as hlog

PAGE = 16384
NS = "kv"
FAKE_NODES = 300
NOGROUP = 65534
GARBAGE = 256 * 1024  # bytes of garbage a fake node's log


def _page(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def _prepare(own: str) -> None:
    """The operator's share: the 3FS dir made for group nogroup (2770), as a fleet's is."""
    root = os.path.join(own, "3fs")
    os.mkdir(root)
    os.chown(root, -1, NOGROUP)
    os.chmod(root, 0o2770)


def _setup(t: Target) -> dict:
    c = SidecarClient(t.url, token=t.token, timeout=60)
    c.put_namespace(NS, PAGE, model="redteam")
    for i in range(64):
        c.put_page(NS, f"real{i}", _page(f"real{i}"))
    c.request("POST", "/v1/flush")
    c.request("POST", f"/v1/namespaces/{NS}/evict", {"keys": [f"real{i}" for i in range(64)]})
    return {"real_pages": 64}


def _forge(root: str) -> dict:
    """As nobody: fake nodes with garbage logs, and forged records from the real log."""
    nodes = os.path.join(root, "nodes")
    real = [n for n in os.listdir(nodes) if n != "evil" and not n.startswith("fake")]
    made = 0
    for i in range(FAKE_NODES):
        d = os.path.join(nodes, f"fake{i}")
        os.mkdir(d)
        with open(os.path.join(d, hlog.log_name(0)), "wb") as f:
            f.write(os.urandom(GARBAGE) + hlog.MAGIC * 64)
        made += 1
    with open(os.path.join(nodes, real[0], hlog.log_name(0)), "rb") as f:
        records, _, _ = hlog.parse(f.read())
    evil = os.path.join(nodes, "evil")
    os.mkdir(evil)
    forged = []
    for r in records:
        if r.op != hlog.PUT:
            continue
        other = hlog.node_tag("evil")
        forged.append(
            hlog.Record(hlog.PUT, r.h, r.node, r.ident, r.file, r.slot, r.length, 0, r.key)
        )
        forged.append(hlog.Record(hlog.PUT, r.h ^ 1, other, r.ident, 0, 0, r.length, 0, r.key))
        forged.append(hlog.Record(hlog.PUT, r.h, other, r.ident, r.file, (r.slot + 1) % 64,
                                  r.length, 0, r.key))  # fmt: skip
    with open(os.path.join(evil, hlog.log_name(0)), "wb") as f:
        f.write(b"".join(map(hlog.encode, forged)))
    return {"fake_nodes": made, "forged_records": len(forged)}


def forged_3fs_logs(t: Target, stop: threading.Event) -> dict:
    root = os.path.join(os.path.dirname(t.socket), "3fs")
    facts = as_user(_forge, root, uid=NOBODY, groups=(NOGROUP,))
    stop.wait(3.0)  # a few polls and a node listing
    c = SidecarClient(t.url, token=t.token, timeout=60)
    got = [c.get_page(NS, f"real{i}") for i in range(64)]
    wrong = sum(g is not None and g != _page(f"real{i}") for i, g in enumerate(got))
    tier = c.stats()["tiers"]["hf3fs"]
    return {
        **facts,
        "served": sum(g is not None for g in got),
        "wrong_bytes": wrong,
        "damaged_records": tier["damaged_records"],
        "nodes_seen": tier["nodes"],
        "held": wrong == 0 and tier["damaged_records"] > 0,
    }


ATTACKS = [
    Attack(
        55,
        "forged_3fs_logs",
        forged_3fs_logs,
        seconds=8.0,
        token=None,
        sidecar_args=("--hf3fs-dir", "{own}/3fs", "--hf3fs-group", "nogroup", "--no-file-tier"),
        prepare=_prepare,
        setup=_setup,
    ),
]
