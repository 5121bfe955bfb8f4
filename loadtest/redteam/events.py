"""Red-team attacks on KV events (issue 43: 3, 4, 7; sidecar/events.py), for
`python -m loadtest.redteam.runner`: another uid subscribes to the `ipc://` event sockets; another
uid reads a tenant's prompts from a loopback TCP endpoint; a tenant makes the largest
events it may while a subscriber never reads; a create-delete loop of namespaces; 20
subscribers that never read join one after another (issue 52, item 5).

A victim tenant (uid VICTIM, engine socket) stores pages with their token ids; the
attacker is uid nobody (or OTHER), in no group."""

from __future__ import annotations

# every module a child as another uid needs is loaded here: it cannot read this
# interpreter's files (msgspec imports decimal when it decodes)
import decimal  # noqa: F401
import errno
import os
import socket
import threading
import time

import msgspec
import zmq
import zmq.utils.monitor  # (read by a child as another uid)

from api.engine.client import SidecarClient, SidecarError
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.as_uid import as_user
from loadtest.kit.procs import free_port
from loadtest.redteam.attack import Attack, Target

VICTIM, OTHER = 65533, 65532
PAGE = 4096
TOKEN = "redteam-token"  # the runner's sidecar token (`Attack.token`)
PROMPT = [424242 + i for i in range(16)]  # the victim's token ids: found = leaked
TCP = free_port()  # the loopback endpoint of the TCP attack (its replay: + 1)


def _victim(url: str, name: str, rounds: int = 4) -> int:
    """A tenant's sets of 4 pages with their tokens (16 a page); the pages it stored."""
    c = SidecarClient(url, token=TOKEN, timeout=60)
    c.put_namespace(name, PAGE, key_format="vllm", page_tokens=16)
    buf = SharedBuffer(4 * PAGE)
    bid = buf.register(c, name, 4, page_first_chunks(PAGE))
    stored = 0
    for r in range(rounds):
        keys = [f"{r * 4 + i + 1:064x}" for i in range(4)]
        got = c.request(
            "POST",
            f"/v1/namespaces/{name}/set",
            {"keys": keys, "buffer_id": bid, "slots": [0, 1, 2, 3], "tokens": [PROMPT] * 4},
        )[1]
        stored += sum(got["stored"])
    buf.close()
    return stored


def _connect(path: str) -> str:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return "connected"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    finally:
        s.close()


def _read_all(pub: str, replay: str, seconds: float) -> dict:
    """Subscribe to everything for `seconds` and replay from seq 0: what was read."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    topics, tokens, batches, end = set(), 0, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for sock in (sub, dealer):
            if sock.poll(20):
                frames = sock.recv_multipart()
                topic, payload = frames[-3], frames[-1]
                if not payload:
                    continue
                batches += 1
                topics.add(topic.decode(errors="replace"))
                for ev in msgspec.msgpack.decode(payload)[1]:
                    ids = ev.get("token_ids") if isinstance(ev, dict) else None
                    tokens += sum(t in PROMPT for t in ids or ())
    ctx.destroy(linger=0)
    return {"batches": batches, "topics": sorted(topics), "prompt_ids": tokens}


# -- 3: the ipc:// sockets, another uid -------------------------------------------------------
def _ipc_subscriber(t: Target, stop: threading.Event) -> dict:
    own = os.path.join(os.path.dirname(t.workdir), "own")
    pub, rep = os.path.join(own, "ev.pub"), os.path.join(own, "ev.replay")
    stored = as_user(_victim, t.socket_url, "secret-model", uid=VICTIM)
    refused = {p.rsplit("/", 1)[1]: as_user(_connect, p) for p in (pub, rep)}
    nobody = as_user(_read_all, f"ipc://{pub}", f"ipc://{rep}", 1.0)
    own = _read_all(f"ipc://{pub}", f"ipc://{rep}", 1.0)  # the sidecar's user: served
    return {
        "held": all(v == "EACCES" for v in refused.values())
        and nobody["batches"] == 0
        and own["prompt_ids"] > 0,
        "stored": stored,
        "nobody_connect": refused,
        "nobody_read": nobody,
        "own_user_read": own,
    }


# -- 3: a loopback TCP endpoint, token ids not opted in -------------------------------------
def _tcp_reader(t: Target, stop: threading.Event) -> dict:
    stored = as_user(_victim, t.socket_url, "secret-model", uid=VICTIM)
    got = as_user(_read_all, f"tcp://127.0.0.1:{TCP}", f"tcp://127.0.0.1:{TCP + 1}", 1.5)
    # names and block hashes are open there (a warning at start says so); prompts are not
    return {
        "held": got["batches"] > 0 and got["prompt_ids"] == 0,
        "stored": stored,
        "nobody_read": got,
    }


# -- 4: the largest events, a subscriber that never reads -----------------------------------
def _stuck(endpoint: str, seconds: float) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    time.sleep(seconds)  # reads nothing: ZMQ queues for it on the sidecar's side
    ctx.destroy(linger=0)
    return 0


def _largest_sets(url: str, seconds: float) -> dict:
    """32,000 token ids a key (issue 43's attack): refused; then the most the cap allows,
    7 keys of 4,096 ids of 9 bytes each a set, without pause."""
    c = SidecarClient(url, token=TOKEN, timeout=60)
    c.put_namespace("hog", PAGE, key_format="vllm", page_tokens=4096)
    buf = SharedBuffer(7 * PAGE)
    bid = buf.register(c, "hog", 7, page_first_chunks(PAGE))
    try:
        c.request(
            "POST",
            "/v1/namespaces/hog/set",
            {"keys": ["a"], "buffer_id": bid, "slots": [0], "tokens": [[1] * 32000]},
        )
        over = 200
    except SidecarError as exc:
        over = exc.status
    ids, n, end = [2**63 - 1] * 4096, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        keys = [f"{n * 7 + i + 1:064x}" for i in range(7)]
        c.request(
            "POST",
            "/v1/namespaces/hog/set",
            {"keys": keys, "buffer_id": bid, "slots": list(range(7)), "tokens": [ids] * 7},
        )
        n += 1
    buf.close()
    return {"over_cap_status": over, "sets": n}


def _flood(t: Target, stop: threading.Event) -> dict:
    seconds = 12.0
    stuck = threading.Thread(target=as_user, args=(_stuck, f"tcp://127.0.0.1:{TCP}", seconds + 3))
    stuck.start()
    time.sleep(1.0)  # (it has joined; a join missed only sends it less)
    got = as_user(_largest_sets, t.socket_url, seconds, uid=OTHER)
    stats = SidecarClient(t.url, token=TOKEN).request("GET", "/v1/stats")[1].get("events", {})
    stuck.join(30)
    return {"held": got["over_cap_status"] == 400 and got["sets"] > 0, **got, "events": stats}


# -- 7: a create-delete loop -------------------------------------------------------------------
def _churn(url: str, seconds: float) -> int:
    c = SidecarClient(url, token=TOKEN, timeout=60)
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        c.put_namespace(f"churn-{n}", PAGE)
        c.delete_namespace(f"churn-{n}")
        n += 1
    return n


def _churn_attack(t: Target, stop: threading.Event) -> dict:
    loops = as_user(_churn, t.socket_url, 8.0, uid=OTHER)
    stats = SidecarClient(t.url, token=TOKEN).request("GET", "/v1/stats")[1]["events"]
    return {
        "held": loops > 0 and stats.get("identities", 1 << 30) == 0,
        "loops": loops,
        "events": stats,
    }


# -- 52 (5): subscribers that never read, one after another -------------------------------------
QUEUE_MIB, MAX_SUBSCRIBERS = 64, 4  # --kv-events-queue-bytes, --kv-events-max-subscribers


def _never_read(endpoint: str, count: int, apart: float, hold: float) -> list[dict]:
    """`count` SUBs that never read (one message at most on their side), one every `apart`
    seconds, held `hold` seconds after the last; each one's handshakes as its monitor saw
    them (admitted: succeeded; dropped: closed, a refused one's each time) and whether
    anything reached it."""
    ctx = zmq.Context()
    subs = []
    for _ in range(count):
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        subs.append((sock, mon, {"admitted": 0, "dropped": 0}))
        time.sleep(apart)
    time.sleep(hold)
    out = []
    for sock, mon, seen in subs:
        while mon.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(mon)["event"]
            key = "admitted" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "dropped"
            seen[key] += 1
        out.append({**seen, "got": bool(sock.poll(0))})
    ctx.destroy(linger=0)
    return out


def _subscribers(t: Target, stop: threading.Event) -> dict:
    """A tenant (OTHER) makes the largest events it may without pause; after 2 s uid
    nobody connects 20 SUBs that never read, 0.3 s apart, each joined while the sets go
    on (so each would hold batches the others do not). The sidecar's RSS is sampled from
    then on. Held: `MAX_SUBSCRIBERS` admitted, every other refused at its handshake
    (nothing reached it), and the RSS grew by less than `--kv-events-queue-bytes`."""
    hog: dict = {}
    sets = threading.Thread(
        target=lambda: hog.update(as_user(_largest_sets, t.socket_url, 16.0, uid=OTHER))
    )
    sets.start()
    time.sleep(2.0)  # its namespace made, the host pool and the ring filling
    rss, done = [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            with open(f"/proc/{t.pid}/status") as f:
                rss.append(next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024)
            done.wait(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    # held past the publisher's 5 s handshake timeout: libzmq closes a few refused
    # connections only then (issue 52's helper saw 3 of 40 first refusals)
    subs = as_user(_never_read, f"tcp://127.0.0.1:{TCP}", 20, 0.3, 6.0)
    sets.join(60)
    done.set()
    sampler.join()
    stats = SidecarClient(t.url, token=TOKEN).request("GET", "/v1/stats")[1].get("events", {})
    admitted = [s for s in subs if s["admitted"]]
    refused = [s for s in subs if not s["admitted"]]
    growth = max(rss) - rss[0]
    return {
        "held": len(admitted) == MAX_SUBSCRIBERS
        and all(s["dropped"] > 0 and not s["got"] for s in refused)
        and growth < QUEUE_MIB
        and hog.get("sets", 0) > 0,
        "admitted": len(admitted),
        "refused": len(refused),
        "refused_that_got_any": sum(s["got"] for s in refused),
        "refusals_seen": sum(s["dropped"] for s in refused),
        "rss_growth_from_first_subscriber_mib": round(growth, 1),
        "sets": hog.get("sets"),
        "events": stats,
    }


EVENTS_IPC = (
    "--kv-events",
    "ipc://{own}/ev.pub",
    "--kv-events-replay",
    "ipc://{own}/ev.replay",
    "--kv-events-token-ids",
)
EVENTS_TCP = (
    "--kv-events",
    f"tcp://127.0.0.1:{TCP}",
    "--kv-events-replay",
    f"tcp://127.0.0.1:{TCP + 1}",
)
ATTACKS = [
    Attack(43, "events ipc: another uid subscribes", _ipc_subscriber, sidecar_args=EVENTS_IPC),
    Attack(43, "events tcp: another uid reads prompts", _tcp_reader, sidecar_args=EVENTS_TCP),
    Attack(
        43,
        "events: largest events, a stuck SUB",
        _flood,
        seconds=20.0,
        sidecar_args=(*EVENTS_TCP, "--kv-events-token-ids", "--kv-events-buffer-bytes", "16MiB"),
    ),
    Attack(43, "events: create-delete loop", _churn_attack, seconds=12.0, sidecar_args=EVENTS_TCP),
    Attack(
        52,
        "events: 20 subscribers that never read",
        _subscribers,
        seconds=20.0,
        sidecar_args=(
            *EVENTS_TCP,
            "--kv-events-token-ids",
            "--kv-events-buffer-bytes",
            "16MiB",
            "--host-pool",
            "8MiB",  # (the pool's own pages filling are not what is measured)
            "--kv-events-queue-bytes",
            f"{QUEUE_MIB}MiB",
            "--kv-events-max-subscribers",
            str(MAX_SUBSCRIBERS),
        ),
        rss_limit_mib=QUEUE_MIB + 32.0,  # from the sidecar's start: its warm-up too
    ),
]
