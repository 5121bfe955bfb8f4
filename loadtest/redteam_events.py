"""Red-team attacks on KV events (issue 43: 3, 4, 7; sidecar/events.py), for
`python -m loadtest.redteam`: another uid subscribes to the `ipc://` event sockets; another
uid reads a tenant's prompts from a loopback TCP endpoint; a tenant makes the largest
events it may while a subscriber never reads; a create-delete loop of namespaces.

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

from api.engine.client import SidecarClient, SidecarError
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.procs import free_port
from loadtest.redteam import Attack, Target, as_user

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
]
