"""Red-team attacks of issue 52 (trust, round 5), for `python -m loadtest.redteam.runner`:

- roles: a tenant with everything an engine holds (and a TCP tenant's own token) tries to
  act as the operator or reach another tenant (items 1);
- answers nobody reads, 200 on each listener, of 4 MiB pages (item 2);
- a tenant that filled the pool alone keeps answers in flight on every segment while a
  newcomer stores (item 4: the ledger);
- a million pins end when an owner comes and when their namespace goes (item 6).
"""

from __future__ import annotations

import os
import socket
import threading
import time

from api.engine.client import SidecarClient, SidecarError
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.as_uid import NOBODY, as_user
from loadtest.kit.calls import status
from loadtest.redteam.attack import Attack, Target

OTHER = 65532  # the attacker's uid; NOBODY is its victim or neighbour
TOKEN = "redteam-token"  # the operator's (the runner's `Attack.token`)
TENANTS = {"alice": "alice-redteam-t0ken-0001", "bob": "bob-redteam-t0ken-00002"}
MIB = 2**20


def _tenants_file(own: str) -> None:
    path = os.path.join(own, "tenants")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{name} {token}\n" for name, token in TENANTS.items())


# -- item 1: roles ------------------------------------------------------------------------
def _victim(url: str) -> None:
    c = SidecarClient(url, timeout=30)  # an engine: no token at all
    c.put_namespace("kv", 4096, model="m")
    c.put_page("kv", "secret", b"s" * 4096)


def _engine_attacker(url: str) -> dict:
    """On the engine socket with the operator's token (as if an engine had been given it)."""
    c = SidecarClient(url, token=TOKEN, timeout=30)
    return {
        "list": sorted(ns["name"] for ns in c.list_namespaces()),
        "read": status(lambda: c.request("GET", "/v1/namespaces/kv@65534/pages/secret")),
        "pin": status(lambda: c.request("POST", "/v1/namespaces/kv@65534/pin", {"keys": ["x"]})),
        "delete": status(lambda: c.delete_namespace("kv@65534")),
    }


def _tcp_tenant(url: str) -> dict:
    """alice's own TCP token: its namespaces only; bob's, the engines' and none else."""
    alice = SidecarClient(url, token=TENANTS["alice"], timeout=30)
    bob = SidecarClient(url, token=TENANTS["bob"], timeout=30)
    bob.put_namespace("bobs", 4096, model="m")
    alice.put_namespace("mine", 4096, model="m")
    return {
        "list": sorted(ns["name"] for ns in alice.list_namespaces()),
        "bobs": status(lambda: alice.request("GET", "/v1/namespaces/bobs@tcp:bob")),
        "uids": status(lambda: alice.request("GET", "/v1/namespaces/kv@65534")),
        "share": status(lambda: alice.put_namespace("g", 4096, share_gid=NOBODY)),
        "anonymous": status(lambda: SidecarClient(url, timeout=30).list_namespaces()),
        "wrong": status(lambda: SidecarClient(url, token=TOKEN + "x").list_namespaces()),
    }


def _roles(t: Target, stop: threading.Event) -> dict:
    as_user(_victim, t.socket_url, uid=NOBODY)
    engine = as_user(_engine_attacker, t.socket_url, uid=OTHER)
    tcp = as_user(_tcp_tenant, t.url, uid=OTHER)
    held = engine == {"list": [], "read": 404, "pin": 404, "delete": 404} and tcp == {
        "list": ["mine"],
        "bobs": 404,
        "uids": 404,
        "share": 403,
        "anonymous": 401,
        "wrong": 401,
    }
    return {"held": held, "engine_socket": engine, "tcp_tenant": tcp}


# -- item 2: answers nobody reads -------------------------------------------------------------
def unread(family: int, address, target: str, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(family)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            s.connect(address)
            s.sendall(f"GET {target} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        except OSError:  # closed at once: past a connection cap
            s.close()
            continue
        socks.append(s)
    return socks


def _one_tenant_unread(path: str, port: int, seconds: float) -> dict:
    c = SidecarClient(f"unix://{path}", timeout=30)
    c.put_namespace("big", 4 * MIB, model="m")
    c.put_page("big", "p", b"\x5a" * (4 * MIB))
    tcp = SidecarClient(f"http://127.0.0.1:{port}", timeout=30)
    tcp.put_namespace("big", 4 * MIB, model="m")
    tcp.put_page("big", "p", b"\x5b" * (4 * MIB))
    target = "/v1/namespaces/big/pages/p"
    socks = unread(socket.AF_UNIX, path, target, 200)
    socks += unread(socket.AF_INET, ("127.0.0.1", port), target, 200)
    time.sleep(seconds)
    whole = c.get_page("big", "p") == b"\x5a" * (4 * MIB)
    for s in socks:
        s.close()
    return {"connections": len(socks), "reader_served_whole": whole}


def _unread_answers(t: Target, stop: threading.Event) -> dict:
    port = int(t.url.rsplit(":", 1)[1])
    facts = as_user(_one_tenant_unread, t.socket, port, 4.0, uid=NOBODY)
    return {"held": facts["reader_served_whole"], **facts}


# -- item 4: the ledger ------------------------------------------------------------------
def _hog(path: str, seconds: float) -> dict:
    """Fill the pool alone (16 segments, a 1 MiB page each), then keep an unread answer
    on every page, asking again and again."""
    c = SidecarClient(f"unix://{path}", timeout=30)
    c.put_namespace("hog", MIB, model="m")
    for i in range(64):
        c.put_page("hog", f"k{i}", bytes([i]) * MIB)
    socks: list[socket.socket] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for i in range(64):
            socks += unread(socket.AF_UNIX, path, f"/v1/namespaces/hog/pages/k{i}", 1)
        time.sleep(0.5)
        while len(socks) > 512:  # keep the attacker's own fds in bounds
            socks.pop(0).close()
    for s in socks:
        s.close()
    return {"asked": True}


def _newcomer(path: str, seconds: float) -> dict:
    c = SidecarClient(f"unix://{path}", timeout=30)
    c.put_namespace("mine", MIB, model="m")
    stored, first_ok = 0, None
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds and stored < 16:
        try:
            c.put_page("mine", f"m{stored}", b"m" * MIB)
            stored += 1
            first_ok = first_ok or round(time.monotonic() - t0, 2)
        except SidecarError:
            time.sleep(0.2)
    return {"stored": stored, "first_stored_after_s": first_ok}


def _answers_everywhere(t: Target, stop: threading.Event) -> dict:
    hog = threading.Thread(target=as_user, args=(_hog, t.socket, 14.0), kwargs={"uid": OTHER})
    hog.start()
    time.sleep(4.0)  # the hog holds every segment before the newcomer comes
    got = as_user(_newcomer, t.socket, 10.0, uid=NOBODY)
    hog.join(60)
    return {"held": got["stored"] >= 16, **got}  # its share: half of 64 segments' worth


# -- item 6: a million pins -------------------------------------------------------------------
def _million_pins(path: str) -> dict:
    c = SidecarClient(f"unix://{path}", timeout=120)
    c.put_namespace("pins", 512, model="m")
    buf = SharedBuffer(4096 * 512)
    bid = buf.register(c, "pins", 4096, page_first_chunks(512))
    n = 0
    for r in range(256):
        keys = [f"k{r}-{i}" for i in range(4096)]
        n += sum(c.set("pins", keys, bid, list(range(4096))))
        c.request("POST", "/v1/namespaces/pins/pin", {"keys": keys, "ttl": 600})
    pinned = c.request("GET", "/v1/namespaces/pins/pins")[1]["pages"]
    return {"stored": n, "pinned": pinned}


def _comes(path: str) -> None:
    """Another uid makes a namespace: the pinner's bound halves."""
    SidecarClient(f"unix://{path}", timeout=30).put_namespace("newcomer", 512, model="m")


def _goes(path: str) -> dict:
    c = SidecarClient(f"unix://{path}", timeout=120)
    left = c.request("GET", "/v1/namespaces/pins/pins")[1]["pages"]
    t0 = time.monotonic()
    c.delete_namespace("pins")
    return {"pins_left_after_bound_halved": left, "delete_s": round(time.monotonic() - t0, 2)}


def _pin_a_million(t: Target) -> dict:
    """The setup (not timed): a tenant pins what its bound allows, 1,048,576 pages."""
    return as_user(_million_pins, t.socket, uid=NOBODY, timeout=600)


def _pins(t: Target, stop: threading.Event) -> dict:
    as_user(_comes, t.socket, uid=OTHER)
    time.sleep(5.0)  # the newest half end, 512 a loop turn, while /healthz is timed
    went = as_user(_goes, t.socket, uid=NOBODY, timeout=300)
    time.sleep(3.0)  # and the rest with the namespace
    return {"held": went["pins_left_after_bound_halved"] <= 2**19, **went}


ATTACKS = [
    Attack(
        52,
        "roles: a tenant with an engine's means and its own TCP token",
        _roles,
        seconds=20.0,
        sidecar_args=("--tenant-tokens", "{own}/tenants"),
        prepare=_tenants_file,
    ),
    Attack(
        52,
        "answers: 200 unread 4 MiB answers on each listener",
        _unread_answers,
        seconds=20.0,
        token=None,
        sidecar_args=("--host-pool", "256MiB", "--segment-size", "4MiB"),
    ),
    Attack(
        52,
        "ledger: a tenant keeps answers in flight on every segment",
        _answers_everywhere,
        seconds=30.0,
        sidecar_args=("--host-pool", "64MiB", "--write-timeout", "2"),
    ),
    Attack(
        52,
        "loop turns: a million pins end as owners come and go",
        _pins,
        seconds=600.0,
        setup=_pin_a_million,
        sidecar_args=("--host-pool", "1GiB", "--segment-size", "8MiB", "--no-file-tier"),
    ),
]
