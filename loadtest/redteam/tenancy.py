"""Red-team attacks on who shares and who is a tenant (issue 43, items 2 and 5), for
`python -m loadtest.redteam.runner`: a uid outside a share group names it, TCP without a token
reserves the whole host pool and reads other tenants' namespace names. Each runs against a
fresh root sidecar (loadtest/redteam/runner.py) without a token, so TCP is anyone on the node."""

from __future__ import annotations

import hashlib
import threading
import urllib.request

from api.engine.client import SidecarClient
from loadtest.kit.as_uid import NOBODY, as_user
from loadtest.kit.calls import status
from loadtest.redteam.attack import Attack, Target

OTHER, MEMBER = 65532, 65531  # the attacker's uid; a second member of the victim's group
GROUP = 4243  # the victim's share group (a supplementary group)
PAGE = 16384
SECRET = "customer-acme-llama"  # a victim's namespace name


def _page(tag: str) -> bytes:
    return hashlib.shake_256(tag.encode()).digest(PAGE)


# -- 2: a uid outside the group names it -----------------------------------------------
def _put_shared(url: str) -> int:
    return status(
        lambda: SidecarClient(url, timeout=60).put_namespace("kv", PAGE, model="m", share_gid=GROUP)
    )


def _victim(url: str) -> str:
    c = SidecarClient(url, timeout=60)
    ident = c.put_namespace("kv", PAGE, model="m", share_gid=GROUP)["identity"]
    c.put_page("kv", "secret", _page("secret"))
    c.request("POST", "/v1/flush?timeout=60")
    return ident


def _attacker(url: str) -> dict:
    c = SidecarClient(url, timeout=60)
    return {
        "put": _put_shared(url),
        "read": status(lambda: c.request("GET", "/v1/namespaces/kv/pages/secret", raw=True)),
        "plant": status(lambda: c.put_page("kv", "planted", _page("evil"))),
        "delete": status(lambda: c.delete_namespace("kv")),
    }


def _member(url: str) -> dict:
    c = SidecarClient(url, timeout=60)
    got = c.put_namespace("kv", PAGE, model="m", share_gid=GROUP)
    return {
        "owner": got["owner"],
        "identity": got["identity"],
        "read": c.get_page("kv", "secret") == _page("secret"),
    }


def non_member_shares(t: Target, stop: threading.Event) -> dict:
    squat = as_user(_put_shared, t.socket_url, uid=OTHER)  # made first: refused
    anonymous = _put_shared(t.url)  # TCP without a token
    ident = as_user(_victim, t.socket_url, uid=NOBODY, groups=[GROUP])
    got = as_user(_attacker, t.socket_url, uid=OTHER)
    many = sorted({*range(70_000, 70_299), GROUP})  # past 256 groups
    member = as_user(_member, t.socket_url, uid=MEMBER, groups=many)
    held = (
        squat == anonymous == 403
        and got == {"put": 403, "read": 404, "plant": 404, "delete": 404}
        and member == {"owner": NOBODY, "identity": ident, "read": True}
    )
    return {
        "held": held,
        "squat": squat,
        "anonymous": anonymous,
        "attacker": got,
        "member_joined": member,
    }


# -- review: a member squats a name in a group every tenant is in ---------------------------
def _squat_everyones_group(url: str) -> int:
    c = SidecarClient(url, timeout=60)
    c.put_namespace("kv", PAGE, share_gid=GROUP)  # a member: allowed
    return status(lambda: c.put_page("kv", "planted", _page("evil")))


def _victim_unjoined(url: str) -> dict:
    """The victim's engine after a sidecar restart or a delete, before its PUT of "kv"."""
    c = SidecarClient(url, timeout=60)
    return {
        "read": status(lambda: c.request("GET", "/v1/namespaces/kv/pages/planted", raw=True)),
        "store": status(lambda: c.put_page("kv", "prompt", _page("victim"))),
    }


def member_squats_a_name(t: Target, stop: threading.Event) -> dict:
    planted = as_user(_squat_everyones_group, t.socket_url, uid=OTHER, groups=[GROUP])
    got = as_user(_victim_unjoined, t.socket_url, uid=NOBODY, groups=[GROUP])
    return {
        "held": planted in (200, 201) and got == {"read": 404, "store": 404},
        "planted": planted,
        "victim": got,
    }


# -- 5: TCP without a token reserves the host pool -----------------------------------------
def _fill(url: str, n: int) -> int:
    c = SidecarClient(url, timeout=60)
    c.put_namespace("mine", PAGE)
    for i in range(n):
        c.put_page("mine", f"k{i}", _page(f"mine{i}"))
    c.request("POST", "/v1/flush?timeout=60")  # written back: its segments are reclaimable
    return c.exists("mine", [f"k{i}" for i in range(n)])


def _after(url: str, n: int) -> dict:
    """What the victim still holds in the host pool, and how many new pages it stores."""
    c = SidecarClient(url, timeout=60)
    host = c.stats()["namespaces"]["mine"]["pages"]["host"]
    stored = sum(
        status(lambda i=i: c.put_page("mine", f"n{i}", _page(f"n{i}"))) == 200 for i in range(n)
    )
    return {"host_pages": host, "new_stored": stored}


def anonymous_reserves_the_pool(t: Target, stop: threading.Event) -> dict:
    before = as_user(_fill, t.socket_url, 256, uid=OTHER)
    tcp = SidecarClient(t.url, timeout=60)
    hog = status(lambda: tcp.put_namespace("hog", PAGE, host_capacity_bytes=64 << 20))
    after = as_user(_after, t.socket_url, 256, uid=OTHER)
    held = hog == 507 and before == 256 and after == {"host_pages": 256, "new_stored": 256}
    return {"held": held, "hog_status": hog, "victim_before": before, "victim_after": after}


# -- 5: TCP without a token reads other tenants' names ---------------------------------------
def _victim_named(url: str) -> None:
    c = SidecarClient(url, timeout=60)
    c.put_namespace(SECRET, PAGE)
    c.put_page(SECRET, "k", _page("k"))


def anonymous_reads_names(t: Target, stop: threading.Event) -> dict:
    as_user(_victim_named, t.socket_url, uid=OTHER)
    tcp = SidecarClient(t.url, timeout=60)
    tcp.put_namespace("tool", PAGE)
    tcp.put_page("tool", "k", _page("t"))
    reads = leaks = 0
    own = True
    while not stop.is_set() or reads == 0:
        for path in ("/v1/stats", "/metrics", "/v1/cost", "/v1/samples", "/v1/namespaces"):
            with urllib.request.urlopen(t.url + path, timeout=60) as r:
                body = r.read().decode()
            reads += 1
            leaks += SECRET in body
            own = own and (path == "/v1/samples" or "tool" in body)
        stop.wait(0.2)
    return {"held": leaks == 0 and own, "reads": reads, "leaks": leaks, "own_names_seen": own}


ATTACKS = [
    Attack(
        43,
        "tenancy: a non-member names the group (squat, read, plant)",
        non_member_shares,
        seconds=1.0,
        token=None,
    ),
    Attack(
        43,
        "tenancy: a member's shared name is no one's unless joined",
        member_squats_a_name,
        seconds=1.0,
        token=None,
    ),
    Attack(
        43,
        "tenancy: anonymous TCP reserves the whole host pool",
        anonymous_reserves_the_pool,
        seconds=1.0,
        token=None,
    ),
    Attack(
        43,
        "tenancy: anonymous TCP reads other tenants' names",
        anonymous_reads_names,
        seconds=3.0,
        token=None,
    ),
]
