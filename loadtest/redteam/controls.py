"""Red-team attacks on the operators' controls (issue 47, sidecar/controls/), for
`python -m loadtest.redteam.runner`: a tenant acts on another's namespace; a tenant pins past its
bound to keep a neighbour's share; a tenant sends the largest chains it may, without pause,
to stall the loop (the runner times /healthz meanwhile); an evict racing a warm of the same
pages (issue 52: the evicted pages must never come back); one tenant's warm jobs against
another tenant's page promotions (issue 52: tier reads are fair per owner)."""

from __future__ import annotations

import hashlib
import threading

from api.engine.client import SidecarClient
from loadtest.kit.as_uid import NOBODY, as_user
from loadtest.kit.calls import status
from loadtest.redteam.attack import Attack, Target

OTHER = 65532  # the attacker's uid; NOBODY is its victim or neighbour
PAGE = 16384
VERBS = ("pin", "unpin", "evict", "warm")
TOKEN = "redteam-token"  # the runner's sidecar token (`Attack.token`): every listener asks it


def _page(tag: str) -> bytes:
    return hashlib.shake_256(tag.encode()).digest(PAGE)


def _post(c: SidecarClient, ns: str, verb: str, body: dict) -> dict:
    return c.request("POST", f"/v1/namespaces/{ns}/{verb}", body)[1]


# -- a tenant on another's namespace --------------------------------------------------------
def _victim_setup(url: str) -> None:
    c = SidecarClient(url, token=TOKEN, timeout=60)
    for ns in ("kv", "team"):
        c.put_namespace(ns, PAGE, **({"share_gid": OTHER} if ns == "team" else {}))
        for k in ("a", "b"):
            c.put_page(ns, k, _page(ns + k))
        _post(c, ns, "pin", {"keys": ["a"]})


def _attacker(url: str) -> dict:
    c = SidecarClient(url, token=TOKEN, timeout=60)
    c.put_namespace("team", PAGE, share_gid=OTHER)  # a member joins the shared one
    return {
        f"{verb} {ns}": status(lambda ns=ns, verb=verb: _post(c, ns, verb, {"chain": ["a", "b"]}))
        for ns in ("kv", "team")
        for verb in VERBS
    }


def _victim_state(url: str) -> dict:
    c = SidecarClient(url, token=TOKEN, timeout=60)
    return {
        ns: (
            c.exists_each(ns, ["a", "b"]),
            c.request("GET", f"/v1/namespaces/{ns}/pins")[1]["pages"],
        )
        for ns in ("kv", "team")
    }


def others_namespace(t: Target, stop: threading.Event) -> dict:
    as_user(_victim_setup, t.socket_url, uid=NOBODY, groups=[OTHER])  # a member may share
    got = as_user(_attacker, t.socket_url, uid=OTHER)
    after = as_user(_victim_state, t.socket_url, uid=NOBODY)
    want = {f"{v} {ns}": (404 if ns == "kv" else 403) for ns in ("kv", "team") for v in VERBS}
    intact = all(present == [True, True] and pins == 1 for present, pins in after.values())
    return {"held": got == want and intact, "answers": got, "victim": after}


# -- pins past the bound against a neighbour's share -------------------------------------------
def _pin_all(url: str) -> dict:
    """Fill the host pool, then pin one page in each of its segments, one at a time."""
    c = SidecarClient(url, token=TOKEN, timeout=120)
    c.put_namespace("hog", PAGE)
    per_seg = 2**20 // PAGE  # (the runner's sidecar: 64 MiB in 1 MiB segments)
    keys = [f"h{i}" for i in range(64 * per_seg)]
    for k in keys:
        c.put_page("hog", k, b"h" * PAGE)
    answers = [status(lambda k=k: _post(c, "hog", "pin", {"keys": [k]})) for k in keys[::per_seg]]
    usage = c.request("GET", "/v1/namespaces/hog/pins")[1]
    return {
        "pinned": answers.count(200),
        "refused": answers.count(507),
        "held_bytes": usage["held_bytes"],
        "bound_bytes": usage["bound_bytes"],
    }


def _neighbour(url: str) -> int:
    """Store a full share (32 segments) and count what stayed in the host pool."""
    c = SidecarClient(url, token=TOKEN, timeout=120)
    c.put_namespace("mine", PAGE)
    for i in range(32 * (2**20 // PAGE)):
        c.put_page("mine", f"m{i}", b"m" * PAGE)
    return c.stats()["namespaces"]["mine"]["pages"]["host"]


def pin_past_bound(t: Target, stop: threading.Event) -> dict:
    pins = as_user(_pin_all, t.socket_url, uid=OTHER, timeout=600)
    held = as_user(_neighbour, t.socket_url, uid=NOBODY, timeout=600)
    share = 32 * (2**20 // PAGE)
    ok = pins["held_bytes"] <= pins["bound_bytes"] and pins["refused"] > 0 and held == share
    return {"held": ok, **pins, "neighbour_host_pages": held, "neighbour_share": share}


# -- the largest chains, without pause --------------------------------------------------------
def _flood(url: str, stop_flag: str) -> dict:
    import os

    c = SidecarClient(url, token=TOKEN, timeout=120)
    c.put_namespace("big", PAGE, host_capacity_bytes=8 * 2**20)
    chain = [f"k{i:05d}" for i in range(4096)]
    for k in chain[:1024]:
        c.put_page("big", k, b"b" * PAGE)
    counts = {"requests": 0, "5xx": 0, "413": 0}
    while not os.path.exists(stop_flag):
        for verb, body in (
            ("pin", {"chain": chain, "ttl": 5}),
            ("warm", {"chain": chain}),
            ("unpin", {"keys": chain}),
            ("evict", {"chain": chain, "from": chain[2048]}),
            ("pin", {"chain": chain + ["x"]}),
        ):
            s = status(lambda verb=verb, body=body: _post(c, "big", verb, body))
            counts["requests"] += 1
            counts["5xx"] += s >= 500 and s != 507
            counts["413"] += s == 413
    return counts


def huge_chains(t: Target, stop: threading.Event) -> dict:
    import os

    flag = os.path.join(t.workdir, "stop-flood")
    threading.Thread(target=lambda: (stop.wait(), open(flag, "w").close()), daemon=True).start()
    got = as_user(_flood, t.socket_url, flag, uid=OTHER, timeout=600)
    return {"held": got["requests"] > 5 and got["5xx"] == 0 and got["413"] > 0, **got}


# -- pin records in the data dir kept busy (sidecar/controls/pin_store.py) ---------------------
def _pin_flood(url: str, stop_flag: str) -> dict:
    """Pin and unpin in 8 namespaces without pause: each answer waits for a record write."""
    import os

    c = SidecarClient(url, token=TOKEN, timeout=120)
    for i in range(8):
        c.put_namespace(f"f{i}", PAGE)
        c.put_page(f"f{i}", "k", b"f" * PAGE)
    open(stop_flag + ".go", "w").close()  # the neighbour pins from now on
    counts = {"requests": 0, "5xx": 0}
    while not os.path.exists(stop_flag):
        for i in range(8):
            for verb in ("pin", "unpin"):
                s = status(lambda i=i, verb=verb: _post(c, f"f{i}", verb, {"keys": ["k"]}))
                counts["requests"] += 1
                counts["5xx"] += s >= 500
    return counts


def _kept_pins(url: str, go: str) -> dict:
    """A neighbour pins 20 pages one at a time once the flood runs: each kept, and how
    long each answer took."""
    import os
    import time

    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)  # (another process's flag: polled)
    c = SidecarClient(url, token=TOKEN, timeout=120)
    c.put_namespace("mine", PAGE)
    took, kept = [], 0  # (reported as pins_kept: "kept" is the runner's verdict)
    for i in range(20):
        c.put_page("mine", f"m{i}", b"m" * PAGE)
        t0 = time.perf_counter()
        kept += bool(_post(c, "mine", "pin", {"keys": [f"m{i}"], "ttl": 600})["persisted"])
        took.append(time.perf_counter() - t0)
    took.sort()
    return {"pins_kept": kept, "median_ms": took[10] * 1000, "max_ms": took[-1] * 1000}


def pin_records_flood(t: Target, stop: threading.Event) -> dict:
    import os

    flag = os.path.join(t.workdir, "stop-pins")
    got: dict = {}
    flood = threading.Thread(
        target=lambda: got.update(as_user(_pin_flood, t.socket_url, flag, uid=OTHER, timeout=600))
    )
    flood.start()
    try:
        mine = as_user(_kept_pins, t.socket_url, flag + ".go", uid=NOBODY, timeout=600)
    finally:
        open(flag, "w").close()
        flood.join(600)
    ok = mine["pins_kept"] == 20 and mine["max_ms"] < 2000 and got.get("5xx", 1) == 0
    return {"held": ok and got["requests"] > 0, **mine, "flood": got}


# -- an evict racing a warm of the same pages (issue 52) -------------------------------------
def _settle_job(c: SidecarClient, job: str) -> dict:
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = c.request("GET", f"/v1/warm/{job}")[1]
        if state["state"] != "running":
            return state
        time.sleep(0.01)  # (the sidecar's job: polled)
    raise TimeoutError(f"warm job {job} still running after 120 s")


def _evict_vs_warm(url: str, rounds: int) -> dict:
    """Each round: 1,024 pages, 768 of them in the file tier only (a 256-page namespace);
    a warm of all of them, then at once (or a few ms later) an evict of all of them. Once
    the warm has ended, no page may be anywhere: the evict answered them deleted."""
    import time

    c = SidecarClient(url, token=TOKEN, timeout=120)
    c.put_namespace("race", PAGE, host_capacity_bytes=4 * 2**20)
    out = {"rounds": rounds, "warmed": 0, "deleted": 0, "came_back": 0, "gets_served": 0}
    for r in range(rounds):
        keys = [f"r{r}-{i}" for i in range(1024)]
        for k in keys:
            c.put_page("race", k, _page(k))
        c.request("POST", "/v1/flush")
        job = _post(c, "race", "warm", {"chain": keys})["job"]
        time.sleep(0.002 * (r % 4))  # the evict meets the warm at another step each round
        got = _post(c, "race", "evict", {"chain": keys})
        state = _settle_job(c, job)
        out["warmed"] += state["loaded"]
        out["deleted"] += got["deleted"]
        out["came_back"] += sum(c.exists_each("race", keys))
        out["gets_served"] += sum(c.get_page("race", k) is not None for k in keys[::64])
    return out


def evict_races_warm(t: Target, stop: threading.Event) -> dict:
    got = as_user(_evict_vs_warm, t.socket_url, 8, uid=OTHER, timeout=600)
    held = got["came_back"] == 0 and got["gets_served"] == 0
    return {"held": held and got["deleted"] == 8 * 1024, **got}


# -- one tenant's warm jobs against another's promotions (issue 52) ----------------------------
# (a 512 MiB host pool: 8 MiB segments, a tenant reserves 16 of them at most)
VICTIM_PAGE = 64 * 1024
VICTIM_PAGES = 2048  # 128 of them in the host pool
FLOOD_PAGE = 256 * 1024
FLOOD_PAGES = 1024  # 256 MiB in the file tier, 256 pages in the host pool


def _victim_page(tag: str) -> bytes:
    return hashlib.shake_256(tag.encode()).digest(VICTIM_PAGE)


def _victim_pages(url: str) -> None:
    """2,048 pages in a 128-page namespace: a get walking them mostly promotes."""
    c = SidecarClient(url, token=TOKEN, timeout=120)
    c.put_namespace("victim", VICTIM_PAGE, host_capacity_bytes=8 * 2**20)
    for i in range(VICTIM_PAGES):
        c.put_page("victim", f"v{i}", _victim_page(f"v{i}"))
    c.request("POST", "/v1/flush")


def _promotions(url: str, go: str | None, first: int, n: int, done: str | None = None) -> dict:
    """Up to `n` gets (20 s at most) of pages in the file tier only, one at a time, each
    timed, from the `first`-th page of a walk that meets every page once a lap (once `go`
    exists; then `done` is made)."""
    import os
    import time

    start = time.monotonic()
    while go is not None and not os.path.exists(go) and time.monotonic() < start + 60:
        time.sleep(0.01)  # (another process's flag: polled)
    waited = time.monotonic() - start
    c = SidecarClient(url, token=TOKEN, timeout=120)
    took, wrong = [], 0
    deadline = time.monotonic() + 20
    for i in range(first, first + n):
        k = f"v{(i * 7) % VICTIM_PAGES}"  # (7 is prime to 2,048: every page once a lap)
        t0 = time.perf_counter()
        wrong += c.get_page("victim", k) != _victim_page(k)
        took.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    if done is not None:
        open(done, "a").close()  # (here: the runner's join of this child may take longer)
    took.sort()
    m = len(took)
    return {
        "gets": m,
        "median_ms": took[m // 2] * 1000,
        "p90_ms": took[m * 9 // 10] * 1000,
        "max_ms": took[-1] * 1000,
        "wrong": wrong,
        "waited_s": round(waited, 2),
        "took_s": round(time.monotonic() - start - waited, 2),
    }


def _warm_flood(url: str, stop_flag: str) -> dict:
    """Warm 4 chains of 256 pages of 256 KiB through a 256-page namespace, one job each (the
    most an owner runs: 4; distinct pages, so they never wait for each other's loads; each
    warm step reads 2 batches of 8 MiB), again as each ends, until told."""
    import os
    import time

    c = SidecarClient(url, token=TOKEN, timeout=120)
    c.put_namespace("flood", FLOOD_PAGE, host_capacity_bytes=256 * FLOOD_PAGE)
    chain = [f"f{i:05d}" for i in range(FLOOD_PAGES)]
    for k in chain:
        c.put_page("flood", k, b"f" * FLOOD_PAGE)
    c.request("POST", "/v1/flush")
    counts = {"warm_jobs": 0, "refused": 0}
    deadline = time.monotonic() + 120
    while not os.path.exists(stop_flag) and time.monotonic() < deadline:
        part = chain[(counts["warm_jobs"] % 4) * 256 :][:256]
        s = status(lambda part=part: _post(c, "flood", "warm", {"chain": part}))
        counts["warm_jobs"] += s == 200
        if s == 429:
            if not counts["refused"]:  # 4 running: the victim times its gets from now on
                open(stop_flag + ".go", "w").close()
            counts["refused"] += 1
            time.sleep(0.005)  # the next starts when one ends
    return counts


def warm_flood_vs_promotions(t: Target, stop: threading.Event) -> dict:
    import os

    as_user(_victim_pages, t.socket_url, uid=NOBODY, timeout=600)
    alone = as_user(_promotions, t.socket_url, None, 0, 400, uid=NOBODY, timeout=600)
    flag = os.path.join(t.workdir, "stop-warm")
    flood: dict = {}

    def run_flood() -> None:
        try:
            flood.update(as_user(_warm_flood, t.socket_url, flag, uid=OTHER, timeout=600))
        except Exception as exc:  # reported; the victim must not wait for it
            flood["error"] = repr(exc)[:300]
        finally:
            open(flag + ".go", "a").close()

    thread = threading.Thread(target=run_flood)
    thread.start()
    try:
        loaded = as_user(
            _promotions, t.socket_url, flag + ".go", 400, 400, flag, uid=NOBODY, timeout=600
        )
    finally:
        open(flag, "a").close()
        thread.join(600)
    ratio = loaded["median_ms"] / max(alone["median_ms"], 1e-3)
    ok = ratio <= 3.0 and alone["wrong"] == loaded["wrong"] == 0 and flood.get("warm_jobs", 0) > 0
    return {
        "held": ok,
        "alone_median_ms": round(alone["median_ms"], 2),
        "loaded_median_ms": round(loaded["median_ms"], 2),
        "ratio": round(ratio, 2),
        "alone_p90_ms": round(alone["p90_ms"], 2),
        "loaded_p90_ms": round(loaded["p90_ms"], 2),
        "loaded_max_ms": round(loaded["max_ms"], 2),
        "gets": (alone["gets"], loaded["gets"]),
        "victim_waited_s": loaded["waited_s"],
        "victim_took_s": loaded["took_s"],
        "flood": flood,
    }


ATTACKS = [
    Attack(47, "controls: a tenant pins, evicts and warms another's namespace", others_namespace),
    Attack(
        47,
        "controls: a tenant pins past its bound against a neighbour's share",
        pin_past_bound,
        seconds=120,
    ),
    Attack(47, "controls: the largest chains to pin, warm and evict, without pause", huge_chains),
    Attack(
        47,
        "pins kept: a tenant's pin and unpin flood keeps the records' disk busy",
        pin_records_flood,
    ),
    Attack(52, "controls: evict races a warm", evict_races_warm, seconds=120),
    Attack(
        52,
        "warm jobs of one tenant vs another's promotions",
        warm_flood_vs_promotions,
        seconds=120,
        sidecar_args=("--host-pool", "512MiB"),
        rss_limit_mib=256.0,
    ),
]
