"""Red-team attacks on lent memory (issue 26, items 2, 4, 5 and 10), for
`python -m loadtest.redteam.runner`. Each runs against a fresh root sidecar (loadtest/redteam/runner.py):
the attacker is a child process of uid nobody, the victim an engine of another uid that
lends, registers and moves pages while the attack holds (`_victim`, its slowest call kept).
A child cannot see the runner's `stop` event: `_shared_stop` mirrors it into one it can."""

from __future__ import annotations

import array
import ctypes
import multiprocessing as mp
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from api.engine.client import SidecarClient, SidecarError
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.as_uid import as_user
from loadtest.redteam.attack import Attack, Target
from loadtest.redteam.hostile import lingering_tcp as lingering_pair

OTHER = 65532  # the victim tenant's uid
PAGE = 4096
FRAME = b"LEND\n"


def _shared_stop(stop: threading.Event):
    """An Event a forked child sees, set when `stop` is."""
    shared = mp.get_context("fork").Event()
    threading.Thread(target=lambda: (stop.wait(), shared.set()), daemon=True).start()
    return shared


def _status(call: Callable[[], Any]) -> int:
    try:
        call()
    except SidecarError as exc:
        return exc.status
    return 201


def _lend_raw(path: str, fds: list[int]) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(30)
    s.connect(path + ".fds")
    s.sendmsg([FRAME], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    return s


def _victim(url: str) -> dict:
    """Another tenant's engine: lend a memfd, register it, set and get 16 pages, release."""
    t0 = time.perf_counter()
    c = SidecarClient(url, timeout=30)
    c.put_namespace("victim", PAGE)
    buf = SharedBuffer(16 * PAGE)
    bid = buf.register(c, "victim", 16, page_first_chunks(PAGE))
    keys = [f"v{i}" for i in range(16)]
    ok = all(c.set("victim", keys, bid, list(range(16)))) and all(
        c.get("victim", keys, bid, list(range(16)))
    )
    c.release_buffer("victim", bid)
    c.close()
    return {"ok": ok, "ms": round((time.perf_counter() - t0) * 1e3, 1)}


def _victim_during(t: Target, ready, stop: threading.Event) -> dict:
    """The victim's round once the attacker is `ready` (an mp.Event), as uid OTHER."""
    if not ready.wait(60):
        return {"ok": False, "ms": None, "error": "the attacker never got ready"}
    return as_user(_victim, t.socket_url, uid=OTHER)


def _attack(t: Target, stop: threading.Event, fn: Callable, *args) -> tuple[dict, dict]:
    """Run `fn(*args, ready, stop)` as nobody in a thread and the victim meanwhile: (the
    attacker's facts, the victim's)."""
    ctx = mp.get_context("fork")
    ready, shared = ctx.Event(), _shared_stop(stop)
    out: dict = {}
    th = threading.Thread(
        target=lambda: out.update(facts=as_user(fn, *args, ready, shared, timeout=300))
    )
    th.start()
    victim = _victim_during(t, ready, stop)
    stop.wait()
    th.join(300)
    return out.get("facts", {"error": "the attacker did not report"}), victim


# -- item 2: a TCP socket whose close blocks, lent on the fd socket ----------------------------
def _lend_lingering(path: str, ready, stop) -> dict:
    """8 lingering sockets, each in a frame of its own connection, and 8 more in one frame
    (more fds than a frame may carry: the kernel drops the extras in the receiver)."""
    held, conns = [], []
    for n in (1,) * 8 + (8,):
        pairs = [lingering_pair() for _ in range(n)]
        conns.append(_lend_raw(path, [cli.fileno() for _, cli in pairs]))
        for lst, cli in pairs:
            cli.close()  # the sidecar's copy is the last: its close lingers
            held.append(lst)
    answers = set()
    for s in conns:  # this user's own frames wait behind its stuck closes
        answers.add(s.recv(4096).decode().split('"code":"')[1].split('"')[0])
    ready.set()
    stop.wait(60)
    for x in held + conns:
        x.close()
    return {"answers": sorted(answers)}


def lingering_tcp(t: Target, stop: threading.Event) -> dict:
    facts, victim = _attack(t, stop, _lend_lingering, t.socket)
    held = (
        bool(facts.get("answers"))
        and set(facts["answers"]) <= {"bad_request", "forbidden", "busy"}
        and victim["ok"]
    )
    return {"held": held, **facts, "victim": victim}


# -- item 4: lent files whose copies block ------------------------------------------------------
def _o_sync(url: str, workdir: str, ready, stop) -> dict:
    """An O_SYNC file on a disk (6.3 s stalls before) is refused; an O_SYNC file in
    /dev/shm is lent and 64 KiB gets run against it until the end."""
    c = SidecarClient(url, timeout=60)
    c.put_namespace("osync", PAGE)
    path = os.path.join(workdir, "osync")
    with open(path, "wb") as f:
        f.write(bytes(64 << 10))
    disk = _status(
        lambda: c.register_buffer(
            "osync", 64 << 10, 16, page_first_chunks(PAGE), fd=os.open(path, os.O_RDWR | os.O_SYNC)
        )
    )
    shm = f"/dev/shm/kv-redteam-osync-{os.getpid()}"
    with open(shm, "wb") as f:
        f.write(bytes(64 << 10))
    fd = os.open(shm, os.O_RDWR | os.O_SYNC)
    os.unlink(shm)
    bid = c.register_buffer("osync", 64 << 10, 16, page_first_chunks(PAGE), fd=fd)
    keys = [f"k{i}" for i in range(16)]
    c.set("osync", keys, bid, list(range(16)))
    ready.set()
    gets, worst = 0, 0.0
    while not stop.is_set():
        t0 = time.perf_counter()
        c.get("osync", keys, bid, list(range(16)))
        worst, gets = max(worst, time.perf_counter() - t0), gets + 1
    return {"disk_file": disk, "gets": gets, "worst_get_ms": round(worst * 1e3, 1)}


def o_sync_lent_file(t: Target, stop: threading.Event) -> dict:
    facts, victim = _attack(t, stop, _o_sync, t.socket_url, t.workdir)
    return {"held": facts.get("disk_file") == 400 and victim["ok"], **facts, "victim": victim}


def _hold_inode_lock(fd: int, stop) -> int:
    """Allocate and punch 1 GiB of the memfd over and over: fallocate holds its inode
    lock throughout (what pwrite and F_ADD_SEALS wait for)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
    rounds = 0
    while not stop.is_set():
        libc.fallocate(fd, 0, 0, 1 << 30)
        libc.fallocate(fd, 0x02 | 0x01, 0, 1 << 30)  # FALLOC_FL_PUNCH_HOLE | KEEP_SIZE
        rounds += 1
    return rounds


def _fallocate(url: str, ready, stop) -> dict:
    """Gets into an unsealable memfd (pwrite, under its inode lock) and a registration
    (F_ADD_SEALS) while another thread of the owner holds the lock with long fallocates."""
    c = SidecarClient(url, timeout=60)
    c.put_namespace("lock", PAGE)
    fd = os.memfd_create("locked", 0)
    os.ftruncate(fd, 4 << 30)
    bid = c.register_buffer("lock", 16 * PAGE, 16, page_first_chunks(PAGE), fd=fd)
    keys = [f"k{i}" for i in range(16)]
    c.set("lock", keys, bid, list(range(16)))
    rounds: list = []
    th = threading.Thread(target=lambda: rounds.append(_hold_inode_lock(fd, stop)))
    th.start()
    ready.set()
    answers, worst, seal = {}, 0.0, None
    while not stop.is_set():
        t0 = time.perf_counter()
        got = all(c.get("lock", keys, bid, list(range(16))))
        worst = max(worst, time.perf_counter() - t0)
        answers[got] = answers.get(got, 0) + 1
        if seal is None:  # a sealable memfd registered while its lock is held
            sealable = os.memfd_create("sealable", os.MFD_ALLOW_SEALING)
            os.ftruncate(sealable, 4 << 30)
            lock = threading.Thread(target=_hold_inode_lock, args=(sealable, stop))
            lock.start()
            seal = _status(
                lambda fd=sealable: c.register_buffer(
                    "lock", PAGE, 1, page_first_chunks(PAGE), fd=fd
                )
            )
    th.join()
    return {
        "gets": {str(k): v for k, v in answers.items()},
        "worst_get_ms": round(worst * 1e3, 1),
        "sealable_registration": seal,
        "fallocate_rounds": rounds[0] if rounds else 0,
        "bad": [b["bad"] for b in c.get_namespace("lock")["buffers"]],
    }


def inode_lock_fallocate(t: Target, stop: threading.Event) -> dict:
    facts, victim = _attack(t, stop, _fallocate, t.socket_url)
    return {"held": victim["ok"] and "gets" in facts, **facts, "victim": victim}


# -- item 5: sparse registrations filling the address space ---------------------------------
def _sparse(url: str, ready, stop) -> dict:
    """150 registrations of one sparse 128 TiB memfd, whole (as found), then 150 covering
    1 TiB each: the first are each past one user's bound, the next fill the user's share."""
    c = SidecarClient(url, timeout=60)
    c.put_namespace("sparse", PAGE)
    fd = os.memfd_create("sparse", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 128 << 40)
    lease = c.lend_fd(fd)
    statuses: dict = {}
    for span in [128 << 40] * 150 + [1 << 40] * 150:
        body = {
            "transport": "shm",
            "lease": lease,
            "size": span,
            "slots": span // PAGE,
            "chunks": page_first_chunks(PAGE),
        }
        code, _ = c.request("POST", "/v1/namespaces/sparse/buffers", body, ok=range(400, 600))
        statuses[f"{span >> 40}TiB:{code}"] = statuses.get(f"{span >> 40}TiB:{code}", 0) + 1
    ready.set()
    stop.wait(60)
    return {"statuses": statuses}


def sparse_registrations(t: Target, stop: threading.Event) -> dict:
    facts, victim = _attack(t, stop, _sparse, t.socket_url)
    codes = {k.split(":")[1] for k in facts.get("statuses", {})}
    return {
        "held": bool(codes) and codes <= {"201", "429"} and victim["ok"],
        **facts,
        "victim": victim,
    }


# -- item 10: one uid's buffers and fd connections ----------------------------------------------
def _many_buffers(url: str, ready, stop) -> dict:
    """1,024 registrations from one lent fd (16 namespaces of 64)."""
    c = SidecarClient(url, timeout=60)
    buf = SharedBuffer(PAGE)
    lease = c.lend_fd(buf.fd)
    codes: dict = {}
    for n in range(16):
        c.put_namespace(f"hog{n}", PAGE)
        for _ in range(64):
            body = {
                "transport": "shm",
                "lease": lease,
                "size": PAGE,
                "slots": 1,
                "chunks": page_first_chunks(PAGE),
            }
            code, _ = c.request("POST", f"/v1/namespaces/hog{n}/buffers", body, ok=range(400, 600))
            codes[code] = codes.get(code, 0) + 1
    ready.set()
    stop.wait(60)
    return {"registrations": codes}


def buffers_one_uid(t: Target, stop: threading.Event) -> dict:
    facts, victim = _attack(t, stop, _many_buffers, t.socket_url)
    got = facts.get("registrations", {})
    return {
        "held": victim["ok"] and got.get(201, 0) < 1024 and set(got) <= {201, 429},
        **facts,
        "victim": victim,
    }


def _idle_connections(path: str, ready, stop) -> dict:
    """256 connections to the fd socket that send nothing; how many the sidecar closed."""
    conns = []
    for _ in range(256):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path + ".fds")
        conns.append(s)
    ready.set()
    closed: set = set()
    while not stop.is_set() and len(closed) < len(conns):
        readable, _, _ = select.select([s for s in conns if s not in closed], [], [], 0.2)
        for s in readable:
            try:
                if s.recv(4096) == b"":
                    closed.add(s)
            except ConnectionResetError:
                closed.add(s)
    return {"connections": len(conns), "closed_by_sidecar": len(closed)}


def idle_fd_connections(t: Target, stop: threading.Event) -> dict:
    facts, victim = _attack(t, stop, _idle_connections, t.socket)
    held = victim["ok"] and facts.get("closed_by_sidecar") == facts.get("connections")
    return {"held": held, **facts, "victim": victim}


ATTACKS = [
    Attack(2, "lingering_tcp_on_fd_socket", lingering_tcp, seconds=5.0, token=None),
    Attack(4, "o_sync_lent_file", o_sync_lent_file, seconds=4.0, token=None),
    Attack(
        4,
        "inode_lock_fallocate",
        inode_lock_fallocate,
        seconds=8.0,
        token=None,
        sidecar_args=("--copy-deadline", "0.25"),
    ),
    Attack(5, "sparse_128tib_registrations", sparse_registrations, seconds=3.0, token=None),
    Attack(10, "buffers_1024_one_uid", buffers_one_uid, seconds=2.0, token=None),
    Attack(10, "idle_fd_connections_256", idle_fd_connections, seconds=9.0, token=None),
]
