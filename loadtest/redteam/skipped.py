"""Red-team attack on the skipped-restore counter (issue 44, `POST .../skipped`), for
`python -m loadtest.redteam.runner`: a tenant counts on another's namespace (its own, and one shared
with it), sends counts past the bound, and floods its own counter (the runner times /healthz
meanwhile and bounds the sidecar's RSS)."""

from __future__ import annotations

import threading

from api.engine.client import SidecarClient
from loadtest.kit.as_uid import NOBODY, as_user
from loadtest.kit.calls import status
from loadtest.redteam.attack import Attack, Target

OTHER = 65532  # the attacker's uid; NOBODY is its victim
PAGE = 4096
TOKEN = "redteam-token"


def _victim_setup(url: str) -> None:
    c = SidecarClient(url, token=TOKEN, timeout=60)
    c.put_namespace("kv", PAGE)
    c.put_namespace("team", PAGE, share_gid=OTHER)


def _attacker(url: str) -> dict:
    c = SidecarClient(url, token=TOKEN, timeout=60)
    c.put_namespace("team", PAGE, share_gid=OTHER)  # a member joins the shared one
    out = {ns: status(lambda ns=ns: c.skipped(ns, 1, 1)) for ns in ("kv", "team")}
    c.put_namespace("mine", PAGE)
    for field, value in (("loads", 1 << 40), ("pages", -1), ("loads", "9" * 5000)):
        out[f"{field}={str(value)[:12]}"] = status(
            lambda f=field, v=value: c.request("POST", "/v1/namespaces/mine/skipped", {f: v})
        )
    for _ in range(2000):
        c.skipped("mine", 4096, 4096 * 4096)
    out["mine"] = c.stats()["namespaces"]["mine"]["restores_skipped"]
    return out


def _victim_counts(url: str) -> dict:
    stats = SidecarClient(url, token=TOKEN, timeout=60).stats()["namespaces"]
    return {ns: stats[ns]["restores_skipped"] for ns in ("kv", "team")}


def others_counter(t: Target, stop: threading.Event) -> dict:
    as_user(_victim_setup, t.socket_url, uid=NOBODY, groups=[OTHER])
    got = as_user(_attacker, t.socket_url, uid=OTHER)
    after = as_user(_victim_counts, t.socket_url, uid=NOBODY)
    want = {
        "kv": 404,
        "team": 403,
        "loads=109951162777": 400,
        "pages=-1": 400,
        "loads=999999999999": 400,
        "mine": 2000 * 4096,
    }
    return {"held": got == want and after == {"kv": 0, "team": 0}, "answers": got, "victim": after}


ATTACKS = [
    Attack(
        44,
        "skipped: a tenant counts on another's namespace, past the bound, in a flood",
        others_counter,
        seconds=60,
    )
]
