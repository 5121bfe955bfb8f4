"""The trust boundary, tried as an unprivileged local user would (issue 10).

The sidecar runs as root (in this process); each attack runs in a child that drops to uid
`nobody` and talks to the engine socket (made 0666 for these tests). Every attack must fail
with a 4xx and leave the target's bytes untouched; races are forced in a bounded loop.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import multiprocessing as mp
import os
import shutil
import socket
import stat
import tempfile
import threading
import time

import pytest

from api.engine.client import SidecarClient, SidecarError
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.as_uid import as_user
from tests.conftest import wait_for

PAGE = 4096
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


def pattern(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def as_nobody(fn, *args, timeout: float = 60):
    """Run `fn(*args)` in a forked child as uid/gid nobody; return its result (or raise)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            q.put(("ok", fn(*args)))
        except BaseException as exc:  # report, never hang the parent
            q.put(("error", repr(exc)))

    p = ctx.Process(target=child)
    p.start()
    kind, value = q.get(timeout=timeout)
    p.join(timeout)
    assert p.exitcode == 0
    if kind == "error":
        raise AssertionError(f"the child failed: {value}")
    return value


@pytest.fixture
def open_server(make_server):
    """A root sidecar whose engine socket any local user may reach (the worst case)."""
    srv = make_server(socket_mode=0o666)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    c = srv.client()
    # shared with the attacker's group: it reaches the namespace, so what it tries is
    # refused by the buffer and lease rules themselves (tests/api/test_tenancy.py: not shared);
    # made by root in nobody's group (only a member may share: tests/api/test_share_groups_and_anonymous_tcp.py)
    as_user(
        lambda url: SidecarClient(url).put_namespace("victim", PAGE, share_gid=NOBODY),
        srv.socket_url,
        uid=0,
        groups=[0, NOBODY],
    )
    # and nobody joins it (a name means a shared namespace only to whom PUT its spec)
    as_nobody(
        lambda url: SidecarClient(url).put_namespace("victim", PAGE, share_gid=NOBODY),
        srv.socket_url,
    )
    c.put_page("victim", "secret", pattern("secret"))
    yield srv
    c.close()


def status_of(call) -> int:
    try:
        call()
    except SidecarError as exc:
        return exc.status
    return 200


def victim_file(tmpdir: str, mode: int = 0o600) -> str:
    path = os.path.join(tmpdir, "target")
    with open(path, "wb") as f:
        f.write(b"R" * PAGE)
    os.chmod(path, mode)
    return path


# -- registration needs the socket and proof of possession ---------------------------
def test_tcp_callers_cannot_register_memory(open_server):
    tcp = open_server.tcp_client()
    tcp.put_namespace("victim", PAGE)  # the operator's own (TCP) namespace of that name
    buf = SharedBuffer(PAGE)
    body = dict(size=PAGE, slots=1, chunks=page_first_chunks(PAGE))
    with pytest.raises(SidecarError) as e:
        tcp.register_buffer("victim", path="/dev/shm/x", **body)
    assert e.value.status == 403 and e.value.code == "forbidden"
    with pytest.raises(SidecarError) as e:  # the client cannot lend an fd without the socket
        buf.register(tcp, "victim", 1, page_first_chunks(PAGE))
    assert e.value.code == "socket_required"
    status, _ = tcp.request(
        "POST",
        "/v1/namespaces/victim/buffers",
        {"transport": "shm", "pid": os.getpid(), "fd": buf.fd, **body},
        ok=(400, 403),
    )
    assert status == 403


def test_pid_fd_form_is_gone_and_echoes_nothing(open_server, scratch):
    c = open_server.client()
    with open(os.path.join(scratch(), "app.log"), "w") as log:
        status, raw = c.request(
            "POST",
            "/v1/namespaces/victim/buffers",
            {
                "transport": "shm",
                "pid": os.getpid(),
                "fd": log.fileno(),
                "size": PAGE,
                "slots": 1,
                "chunks": page_first_chunks(PAGE),
            },
            ok=(400,),
        )
    assert status == 400 and b"lease" in raw
    assert log.name.encode() not in raw and b"/proc" not in raw


def test_sidecar_memory_cannot_be_registered(open_server):
    c = open_server.client()
    arena = open_server.ctx.arena
    for fd in (arena.fd, os.open(f"/proc/{os.getpid()}/fd/{arena.fd}", os.O_RDWR)):
        with pytest.raises(SidecarError) as e:
            c.lend_fd(fd)
        assert e.value.code == "forbidden"
    status = status_of(
        lambda: c.register_buffer(
            "victim", PAGE, 1, page_first_chunks(PAGE), path=f"/proc/{os.getpid()}/fd/{arena.fd}"
        )
    )
    assert status == 400


def test_lend_frames_are_checked(open_server):
    c = open_server.client()
    r, w = os.pipe()
    with pytest.raises(SidecarError) as e:
        c.lend_fd(r)
    assert e.value.code == "forbidden"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(open_server.config.socket + ".fds")
    buf = SharedBuffer(PAGE)
    s.sendmsg(
        [b"LEND\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [buf.fd, buf.fd]))]
    )
    assert b"bad_request" in s.recv(4096)
    s.sendmsg([b"GIVE ME\n"])
    assert b"bad_request" in s.recv(4096)
    s.sendmsg([b"LEND\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [buf.fd]))])
    assert b'"lease"' in s.recv(4096)  # the connection survived its bad frames
    s.close()
    assert c.health()["status"] == "ok"


# -- attacks from another user -------------------------------------------------------
def _register_path(url: str, path: str) -> int:
    c = SidecarClient(url)
    return status_of(
        lambda: c.register_buffer("victim", PAGE, 1, page_first_chunks(PAGE), path=path)
    )


@root_only
def test_other_users_file_cannot_be_registered(open_server, scratch):
    d = scratch(dir="/dev/shm", prefix="kvs-")
    os.chmod(d, 0o755)
    target = victim_file(d, 0o600)
    assert as_nobody(_register_path, open_server.socket_url, target) == 403
    with open(target, "rb") as f:
        assert f.read() == b"R" * PAGE


def _other_users_buffer(url: str, buffer_id: str) -> dict:
    c = SidecarClient(url)
    out = {
        "get": status_of(lambda: c.get("victim", ["secret"], buffer_id, [0])),
        "set": status_of(lambda: c.set("victim", ["x"], buffer_id, [0])),
        "release": status_of(lambda: c.release_buffer("victim", buffer_id)),
    }
    out["listed"] = any(b["buffer_id"] == buffer_id for b in c.get_namespace("victim")["buffers"])
    return out


@root_only
def test_another_users_buffer_is_unknown(open_server):
    c = open_server.client()
    buf = SharedBuffer(PAGE)
    bid = buf.register(c, "victim", 1, page_first_chunks(PAGE))
    buf.view(0, PAGE)[:] = b"E" * PAGE
    seen = as_nobody(_other_users_buffer, open_server.socket_url, bid)
    assert seen == {"get": 404, "set": 404, "release": 404, "listed": False}
    assert bytes(buf.view(0, PAGE)) == b"E" * PAGE
    tcp = open_server.tcp_client()
    assert status_of(lambda: tcp.get("victim", ["secret"], bid, [0])) == 404
    assert c.get("victim", ["secret"], bid, [0]) == [True]  # its owner still can


_libc = ctypes.CDLL(None, use_errno=True)
RENAME_EXCHANGE = 2


def _symlink_race(url: str, outside: str, seconds: float) -> dict:
    """Swap a directory with a symlink to `outside` while registering a file beneath it."""
    base = tempfile.mkdtemp(dir="/dev/shm", prefix="kvs-att-")
    real, link = os.path.join(base, "d"), os.path.join(base, "l")
    os.mkdir(real)
    with open(os.path.join(real, "target"), "wb") as f:
        f.write(b"A" * PAGE)
    os.symlink(outside, link)
    stop, swaps = threading.Event(), [0]

    def swapper():
        while not stop.is_set():
            _libc.renameat2(-100, real.encode(), -100, link.encode(), RENAME_EXCHANGE)
            swaps[0] += 1

    t = threading.Thread(target=swapper)
    t.start()
    c, codes = SidecarClient(url), {}
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            bid = c.register_buffer(
                "victim", PAGE, 1, page_first_chunks(PAGE), path=os.path.join(real, "target")
            )
            codes["ok"] = codes.get("ok", 0) + 1
            c.get("victim", ["secret"], bid, [0])  # writes the page into what it mapped
            c.release_buffer("victim", bid)
        except SidecarError as exc:
            codes[exc.status] = codes.get(exc.status, 0) + 1
    stop.set()
    t.join()
    shutil.rmtree(base, ignore_errors=True)
    return {"codes": codes, "swaps": swaps[0]}


@root_only
def test_symlink_swap_race_never_leaves_the_shm_dir(open_server, scratch):
    outside = scratch(prefix="kvs-outside-")
    os.chmod(outside, 0o755)
    target = victim_file(outside, 0o644)
    got = as_nobody(_symlink_race, open_server.socket_url, outside, 3.0)
    assert got["swaps"] > 100 and sum(got["codes"].values()) > 20
    assert set(got["codes"]) <= {"ok", 400}, got
    assert 400 in got["codes"], got  # the swapped-in symlink was met, and refused
    with open(target, "rb") as f:
        assert f.read() == b"R" * PAGE


# -- a buffer that shrinks never kills the sidecar -----------------------------------
def _shrink_then_move(c: SidecarClient, fd: int, bid: str) -> tuple[list, list]:
    c.put_page("victim", "shrink", pattern("shrink"))
    os.ftruncate(fd, 0)
    return c.set("victim", ["after-truncate"], bid, [0]), c.get("victim", ["shrink"], bid, [0])


def test_unsealable_memfd_truncated_answers_false(open_server):
    c = open_server.client()
    fd = os.memfd_create("sglang-like", os.MFD_CLOEXEC)  # no MFD_ALLOW_SEALING, as SGLang's
    os.ftruncate(fd, PAGE)
    bid = c.register_buffer("victim", PAGE, 1, page_first_chunks(PAGE), fd=fd)
    assert (
        next(b for b in c.get_namespace("victim")["buffers"] if b["buffer_id"] == bid)["mode"]
        == "fd"
    )
    stored, _ = _shrink_then_move(c, fd, bid)
    assert stored == [False]
    assert c.health()["status"] == "ok" and c.exists("victim", ["after-truncate"]) == 0
    open_server.invariants()


def test_shm_file_truncated_answers_false(open_server, scratch):
    c = open_server.client()
    d = scratch(dir="/dev/shm", prefix="kvs-")
    path = victim_file(d, 0o600)
    bid = c.register_buffer("victim", PAGE, 1, page_first_chunks(PAGE), path=path)
    os.truncate(path, 0)
    assert c.set("victim", ["t"], bid, [0]) == [False]
    assert c.health()["status"] == "ok"
    open_server.invariants()


def test_sealable_memfd_is_sealed_and_mapped(open_server):
    c = open_server.client()
    buf = SharedBuffer(PAGE)
    bid = buf.register(c, "victim", 1, page_first_chunks(PAGE))
    assert (
        next(b for b in c.get_namespace("victim")["buffers"] if b["buffer_id"] == bid)["mode"]
        == "mmap"
    )
    with pytest.raises(PermissionError):
        os.ftruncate(buf.fd, 0)  # sealed against shrinking by the sidecar
    assert c.get("victim", ["secret"], bid, [0]) == [True]
    assert bytes(buf.view(0, PAGE)) == pattern("secret")


# -- a dead engine's buffers go ------------------------------------------------------
def _engine_registers_and_exits(url: str, conn) -> None:
    c = SidecarClient(url)
    buf = SharedBuffer(PAGE)
    conn.send(buf.register(c, "victim", 1, page_first_chunks(PAGE)))
    conn.recv()  # wait until told to die, then die without releasing anything
    os._exit(0)


def test_dead_engine_buffers_are_released(open_server):
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_engine_registers_and_exits, args=(open_server.socket_url, child))
    p.start()
    bid = parent.recv()
    c = open_server.tcp_client()
    assert bid in open_server.on_loop(lambda: open_server.ns("victim").buffers)
    parent.send("die")
    p.join(30)
    wait_for(lambda: bid not in open_server.on_loop(lambda: open_server.ns("victim").buffers), 10)
    assert not open_server.on_loop(lambda: open_server.ctx.store.sources.leases.leases)
    assert c.health()["status"] == "ok"


# -- tenants and files ---------------------------------------------------------------
def test_equal_specs_in_two_namespaces_never_share_tier_pages(make_server, tmp_path):
    srv = make_server(file_tier=True, data_dir=str(tmp_path))
    c = srv.client(timeout=60)
    for ns in ("tenant-a", "tenant-b"):
        c.put_namespace(ns, PAGE, model="m")
    c.put_page("tenant-a", "k", pattern("k"))
    c.request("POST", "/v1/flush", {})
    assert c.exists("tenant-b", ["k"]) == 0 and c.get_page("tenant-b", "k") is None
    for ns in ("shared-a", "shared-b"):
        c.put_namespace(ns, PAGE, model="m", share_scope="team")
    c.put_page("shared-a", "k", pattern("k"))
    c.request("POST", "/v1/flush", {})
    assert c.exists("shared-b", ["k"]) == 1 and c.get_page("shared-b", "k") == pattern("k")


def test_page_files_are_private(make_server, tmp_path):
    data = tmp_path / "data"
    srv = make_server(file_tier=True, data_dir=str(data))
    c = srv.client(timeout=60)
    c.put_namespace("p", PAGE)
    c.put_page("p", "k", pattern("k"))
    c.request("POST", "/v1/flush", {})
    modes = {str(p.relative_to(data)): stat.S_IMODE(p.stat().st_mode) for p in data.rglob("*")}
    assert modes and all(
        m == (0o700 if (data / p).is_dir() else 0o600) for p, m in modes.items()
    ), modes
    assert stat.S_IMODE(data.stat().st_mode) == 0o700


def test_sockets_have_the_configured_mode_and_refuse_a_second_sidecar(make_server, scratch):
    srv = make_server()
    for path in (srv.config.socket, srv.config.socket + ".fds"):
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    from sidecar.peer import bind_unix

    with pytest.raises(RuntimeError, match="listening"):
        bind_unix(srv.config.socket, 0o660)
    stale = os.path.join(scratch(prefix="kvs-"), "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()  # a socket file nobody listens on: replaced
    bind_unix(stale, 0o600).close()
    plain = os.path.join(os.path.dirname(stale), "plain")
    open(plain, "w").close()
    with pytest.raises(RuntimeError, match="not a socket"):
        bind_unix(plain, 0o600)


def test_lent_fds_must_be_read_write_and_not_append(open_server, scratch):
    c = open_server.client()
    d = scratch(dir="/dev/shm", prefix="kvs-")
    path = victim_file(d, 0o600)
    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR | os.O_APPEND, os.O_PATH):
        fd = os.open(path, flags)
        with pytest.raises(SidecarError) as e:
            c.lend_fd(fd)
        assert e.value.code == "forbidden", flags
        os.close(fd)


def test_leases_per_user_are_capped(open_server, monkeypatch):
    from sidecar import leases

    monkeypatch.setattr(leases, "MAX_LEASES_PER_UID", 2)
    c = open_server.client()
    buf = SharedBuffer(PAGE)
    c.lend_fd(buf.fd)
    c.lend_fd(buf.fd)
    with pytest.raises(SidecarError) as e:
        c.lend_fd(buf.fd)
    assert e.value.code == "too_many_buffers"
    c.close_leases()  # the leases end with their connection: room again
    wait_for(
        lambda: not open_server.on_loop(lambda: open_server.ctx.store.sources.leases.leases), 10
    )
    c.lend_fd(buf.fd)


def test_a_dead_engines_path_buffer_is_reaped(open_server, scratch):
    d = scratch(dir="/dev/shm", prefix="kvs-")
    path = victim_file(d, 0o600)
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()

    def engine():
        c = SidecarClient(open_server.socket_url)
        child.send(c.register_buffer("victim", PAGE, 1, page_first_chunks(PAGE), path=path))
        child.recv()
        os._exit(0)

    p = ctx.Process(target=engine)
    p.start()
    bid = parent.recv()
    parent.send("die")
    p.join(30)

    def buffers() -> set:
        return open_server.on_loop(lambda: set(open_server.ns("victim").buffers))

    wait_for(lambda: bid not in buffers(), 10)  # the reaper released the dead engine's buffer
