"""Red-team attacks on what the store promises (issue 26, items 1, 7, 9, 10 and 11), for
`python -m loadtest.redteam.runner`. Each runs against a fresh root sidecar (loadtest/redteam/runner.py);
the tenants are child processes of other uids on the engine socket."""

from __future__ import annotations

import hashlib
import threading
import time
import urllib.request

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.as_uid import NOBODY, as_user
from loadtest.kit.calls import status
from loadtest.redteam.attack import Attack, Target

OTHER = 65532  # a second tenant's uid
PAGE = 16384


def _page(tag: str) -> bytes:
    return hashlib.shake_256(tag.encode()).digest(PAGE)


# -- 1: acknowledged pages under write_through, two tenants on a small pool ---------------
def _writer(url: str, name: str, rounds: int) -> list[str]:
    c = SidecarClient(url, timeout=120)
    c.put_namespace(name, PAGE)  # shared pools: the tenants evict each other's pages
    buf = SharedBuffer(8 * PAGE)
    bid = buf.register(c, name, 8, page_first_chunks(PAGE))
    acked = []
    for r in range(rounds):
        keys = [f"{name}-{r}-{j}" for j in range(8)]
        for j, k in enumerate(keys):
            buf.view(j * PAGE, PAGE)[:] = _page(k)
        acked += [
            k for k, ok in zip(keys, c.set(name, keys, bid, list(range(8))), strict=True) if ok
        ]
    c.request("POST", "/v1/flush?timeout=120")
    return acked


def _lost(url: str, name: str, acked: list[str]) -> int:
    """Acknowledged pages not served back with their bytes after the flush (most come
    back from the file tier: the host pool holds a quarter of what was set)."""
    c = SidecarClient(url, timeout=120)
    return sum(c.get_page(name, k) != _page(k) for k in acked)


def write_through_losses(t: Target, stop: threading.Event) -> dict:
    out, threads = {}, []
    for uid, name in ((NOBODY, "ta"), (OTHER, "tb")):

        def run(uid=uid, name=name):
            acked = as_user(_writer, t.socket_url, name, 40, uid=uid, timeout=600)
            out[name] = (
                len(acked),
                as_user(_lost, t.socket_url, name, acked, uid=uid, timeout=600),
            )

        threads.append(threading.Thread(target=run))
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    acked = sum(a for a, _ in out.values())
    lost = sum(n for _, n in out.values())
    return {"held": acked > 0 and lost == 0, "acked": acked, "lost": lost}


# -- 7: a namespace of tiny pages ------------------------------------------------------
def tiny_pages(t: Target, stop: threading.Event) -> dict:
    c = SidecarClient(t.socket_url, timeout=60)
    refused = status(lambda: c.put_namespace("tiny", 1))
    c.put_namespace("small", 512)
    t0 = time.perf_counter()
    c.put_page("small", "k", b"x" * 512)
    first_put_ms = (time.perf_counter() - t0) * 1e3
    return {"held": refused == 400, "page_bytes_1": refused, "first_put_ms": round(first_put_ms, 1)}


# -- 9: another tenant's namespace ---------------------------------------------------------
def _victim(url: str) -> None:
    c = SidecarClient(url)
    c.put_namespace("victim", PAGE)
    c.put_page("victim", "secret", _page("secret"))


def _thief(url: str) -> dict:
    c = SidecarClient(url)
    return {
        "read": status(lambda: c.request("GET", "/v1/namespaces/victim/pages/secret", raw=True)),
        "delete": status(lambda: c.delete_namespace("victim")),
        "listed": [ns["name"] for ns in c.list_namespaces()],
        "plant": status(lambda: c.put_page("victim", "planted", _page("evil"))),
    }


def _victim_reads(url: str) -> bool:
    c = SidecarClient(url)
    return (
        c.get_page("victim", "secret") == _page("secret") and c.exists("victim", ["planted"]) == 0
    )


def other_tenants_namespace(t: Target, stop: threading.Event) -> dict:
    as_user(_victim, t.socket_url, uid=OTHER)
    seen = as_user(_thief, t.socket_url, uid=NOBODY)
    intact = as_user(_victim_reads, t.socket_url, uid=OTHER)
    held = intact and seen["read"] == 404 and seen["delete"] == 404 and seen["listed"] == []
    return {"held": held, **seen, "victim_intact": intact}


# -- 10: one tenant reserves the whole host pool -----------------------------------------
def _fill(url: str, name: str, n: int) -> int:
    c = SidecarClient(url, timeout=60)
    c.put_namespace(name, PAGE)
    for i in range(n):
        c.put_page(name, f"k{i}", _page(f"{name}{i}"))
    return c.exists(name, [f"k{i}" for i in range(n)])


def _reserve_all(url: str) -> int:
    c = SidecarClient(url, timeout=60)
    return status(lambda: c.put_namespace("hog", PAGE, host_capacity_bytes=64 << 20))


def reserve_the_pool(t: Target, stop: threading.Event) -> dict:
    kept_before = as_user(_fill, t.socket_url, "mine", 256, uid=OTHER)  # 4 MiB of pages
    hog = as_user(_reserve_all, t.socket_url, uid=NOBODY)
    kept_after = as_user(
        lambda u: SidecarClient(u).exists("mine", [f"k{i}" for i in range(256)]),
        t.socket_url,
        uid=OTHER,
    )
    return {
        "held": hog == 507 and kept_after == kept_before == 256,
        "hog_status": hog,
        "victim_pages": [kept_before, kept_after],
    }


# -- 11: thousands of namespaces, scraped --------------------------------------------------
def _make_namespaces(url: str, n: int) -> int:
    c = SidecarClient(url, timeout=60)
    made = 0
    for i in range(n):
        if status(lambda i=i: c.put_namespace(f"ns{i}", 4096)) != 429:
            made += 1
    return made


def many_namespaces(t: Target, stop: threading.Event) -> dict:
    made = sum(as_user(_make_namespaces, t.socket_url, 300, uid=60000 + u) for u in range(16))
    scrapes = 0
    req = urllib.request.Request(t.url + "/metrics")
    while not stop.is_set():
        urllib.request.urlopen(req, timeout=60).read()
        scrapes += 1
    return {"held": made == 16 * 256, "namespaces": made, "scrapes": scrapes}


ATTACKS = [
    Attack(
        1,
        "write_through_two_tenants",
        write_through_losses,
        seconds=1.0,
        token=None,
        sidecar_args=("--write-queue-pages", "4", "--host-pool", "4MiB"),
    ),
    Attack(7, "tiny_pages", tiny_pages, seconds=1.0, token=None),
    Attack(9, "other_tenants_namespace", other_tenants_namespace, seconds=1.0, token=None),
    Attack(10, "reserve_the_whole_pool", reserve_the_pool, seconds=1.0, token=None),
    Attack(
        11,
        "many_namespaces_scraped",
        many_namespaces,
        seconds=8.0,
        token=None,
        sidecar_args=("--host-pool", "256MiB"),
    ),
]
