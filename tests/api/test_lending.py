"""Lent memory cannot stall the event loop or starve other tenants (issue 26, items 2, 4,
5 and 10), end to end on a real sidecar with real sockets and memfds.

A blocking syscall is forced with an event (a spy that holds a close, a check or a copy
until the test lets it go) and the loop is shown to answer meanwhile; where another
tenant matters it is a child process as uid `nobody` (tests/api/test_trust.py)."""

from __future__ import annotations

import array
import errno
import multiprocessing as mp
import os
import select
import socket
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from api.engine.client import SidecarClient, SidecarError
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.redteam.hostile import lingering_tcp
from sidecar import leases, store
from sidecar.transports import shm
from tests.api.test_trust import NOBODY, as_nobody, root_only, status_of
from tests.conftest import Gate, wait_for

PAGE = 4096


@pytest.fixture
def open_server(make_server):
    """A root sidecar whose sockets any local user may reach; `kv` made by this process."""
    srv = make_server(socket_mode=0o666)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    srv.client().put_namespace("kv", PAGE)
    return srv


class Nobody:
    """`fn(*args)` in a forked child as uid nobody, started from this (the main) thread,
    while the test goes on; `result()` waits for what it returned."""

    def __init__(self, fn, *args):
        ctx = mp.get_context("fork")
        self.q = ctx.Queue()

        def child():
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                self.q.put(("ok", fn(*args)))
            except BaseException as exc:  # report, never hang the parent
                self.q.put(("error", repr(exc)))

        self.p = ctx.Process(target=child)
        self.p.start()

    def result(self, timeout: float = 60):
        kind, value = self.q.get(timeout=timeout)
        self.p.join(timeout)
        assert kind == "ok", f"the child failed: {value}"
        return value


def loop_thread(srv) -> int:
    return srv.on_loop(threading.get_ident)


def lend_frame(path: str, fd: int) -> socket.socket:
    """A raw connection to the fd socket that has sent one LEND frame carrying `fd`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path + ".fds")
    s.sendmsg([leases.FRAME], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    return s


def memfd(size: int, sealable: bool = True) -> int:
    fd = os.memfd_create("lent", os.MFD_ALLOW_SEALING if sealable else 0)
    os.ftruncate(fd, size)
    return fd


class CloseSpy:
    """os.close, watched for the fds of one inode: the threads that closed them, and (with
    `hold`) each such close held until `hold` is set."""

    def __init__(self, monkeypatch, inode: int, hold=None):
        self.real, self.inode, self.hold = os.close, inode, hold
        self.threads, self.entered, self.done = [], threading.Event(), threading.Event()
        monkeypatch.setattr(os, "close", self)

    def __call__(self, fd: int) -> None:
        try:
            mine = os.fstat(fd).st_ino == self.inode
        except OSError:
            mine = False
        if mine:
            self.threads.append(threading.get_ident())
            self.entered.set()
            if self.hold is not None:
                assert self.hold.wait(60)
        try:
            self.real(fd)
        finally:
            if mine:
                self.done.set()


# -- item 2: what the fd socket receives is checked and closed off the loop ------------------
def _lend_a_lingering_socket(path: str, inode_box, armed, ours_closed, go) -> bytes:
    lst, cli = lingering_tcp()
    inode_box.put(os.fstat(cli.fileno()).st_ino)
    assert armed.wait(30)  # the test's spy knows which close to watch
    s = lend_frame(path, cli.fileno())
    cli.close()  # the sidecar's copy is the last: its close lingers
    ours_closed.set()
    answer = s.recv(4096)
    assert go.wait(60)  # the listener stays until the test is done: the close blocks
    lst.close()
    return answer


@root_only
def test_a_lingering_tcp_socket_is_closed_off_the_loop(open_server, monkeypatch):
    """uid nobody lends a TCP socket whose close blocks (SO_LINGER, unsent data): it is
    refused, and closed on a lane thread; meanwhile the loop serves this process's lend,
    registration and moves. The old code closed it on the loop (stalled 6-12 s)."""
    ctx = mp.get_context("fork")
    inode_box, armed, ours_closed, go = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    spy = CloseSpy(monkeypatch, -1, hold=ours_closed)
    attack = Nobody(
        _lend_a_lingering_socket, open_server.config.socket, inode_box, armed, ours_closed, go
    )
    try:
        spy.inode = inode_box.get(timeout=30)
        armed.set()
        assert spy.entered.wait(30)
        c = open_server.client(timeout=5)  # the old loop was stuck in the close
        assert c.health()["status"] == "ok"
        buf = SharedBuffer(PAGE)
        bid = buf.register(c, "kv", 1, page_first_chunks(PAGE))
        assert c.set("kv", ["a"], bid, [0]) == [True] and c.get("kv", ["a"], bid, [0]) == [True]
        assert not spy.done.is_set()  # all that while the close was blocked
    finally:
        go.set()
    answer = attack.result(60)
    assert b"forbidden" in answer
    assert spy.done.wait(30) and loop_thread(open_server) not in spy.threads


def test_a_connections_frames_are_checked_off_the_loop_in_order(open_server, monkeypatch):
    """The first frame's check is held: the second waits for it (answers come in order),
    and the loop answers other requests meanwhile."""
    gate = Gate(leases, "_check_lendable", monkeypatch.setattr)
    small, large = memfd(PAGE), memfd(2 * PAGE)
    s = lend_frame(open_server.config.socket, small)
    s.sendmsg([leases.FRAME], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [large]))])
    try:
        assert gate.entered.wait(10)
        assert open_server.client(timeout=5).health()["status"] == "ok"
        assert select.select([s], [], [], 0)[0] == []  # nothing answered while the first is held
    finally:
        gate.open()
    first, second = s.recv(4096), s.recv(4096)
    assert b'"size":4096' in first and b'"size":8192' in second
    s.close()


def test_a_frame_whose_check_overruns_is_answered_and_its_fd_closed(open_server, monkeypatch):
    """A check held past FD_DEADLINE: the frame is answered `busy` at once; when the check
    ends, the fd it brought is closed (off the loop), never made a lease."""
    monkeypatch.setattr(leases, "FD_DEADLINE", 0.3)
    gate = Gate(leases, "_check_lendable", monkeypatch.setattr)
    fd = memfd(PAGE)
    spy = CloseSpy(monkeypatch, os.fstat(fd).st_ino)
    s = lend_frame(open_server.config.socket, fd)
    try:
        assert b'"busy"' in s.recv(4096)
    finally:
        gate.open()
    assert spy.done.wait(10) and loop_thread(open_server) not in spy.threads
    assert open_server.on_loop(lambda: len(open_server.ctx.store.sources.leases.leases)) == 0
    s.sendmsg([leases.FRAME], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    assert b'"lease"' in s.recv(4096)  # the connection goes on
    s.close()


def test_only_memory_can_be_lent(open_server):
    """A regular file on a disk (O_SYNC made one 64 KiB get stall the loop 6.3 s) is
    refused; a memfd and a /dev/shm file are lent."""
    c = open_server.client()
    disk = os.path.join(os.environ["HOME"], "disk-file")
    with open(disk, "wb") as f:
        f.write(bytes(PAGE))
        if shm.fs_type(f.fileno()) in leases.LENDABLE_FS:
            pytest.skip("the temp dir is on tmpfs here")
    for flags in (os.O_RDWR, os.O_RDWR | os.O_SYNC):
        fd = os.open(disk, flags)
        with pytest.raises(SidecarError) as e:
            c.lend_fd(fd)
        assert e.value.code == "forbidden" and "memory" in e.value.message
        os.close(fd)
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as in_shm:
        os.truncate(in_shm.name, PAGE)
        assert c.lend_fd(os.open(in_shm.name, os.O_RDWR)).startswith("l-")
    assert c.lend_fd(memfd(PAGE)).startswith("l-")


def test_lent_and_registered_fds_are_closed_off_the_loop(open_server, monkeypatch):
    c = open_server.client()
    buf = SharedBuffer(PAGE)
    spy = CloseSpy(monkeypatch, os.fstat(buf.fd).st_ino)
    unmapped = []
    real_close = shm.ShmMapping.close
    monkeypatch.setattr(
        shm.ShmMapping, "close", lambda m: (unmapped.append(threading.get_ident()), real_close(m))
    )
    bid = buf.register(c, "kv", 1, page_first_chunks(PAGE))
    c.release_buffer("kv", bid)  # its dup, and the mapping
    wait_for(lambda: len(spy.threads) == 1 and len(unmapped) == 1, 10)
    c.close_leases()  # the lease's own fd
    wait_for(lambda: len(spy.threads) == 2, 10)
    assert loop_thread(open_server) not in spy.threads + unmapped


# -- item 4: no copy and no registration on the loop; a stuck copy costs its caller ----------
def test_no_copy_runs_on_the_loop(open_server, monkeypatch):
    """Small moves ran inline on the loop before; now every copy is on a copy thread, for
    mapped (sealed memfd) and fd-mode (unsealable memfd) buffers alike."""
    threads = []
    for name in ("run_plan", "_fd_plan"):
        real = getattr(shm, name)
        monkeypatch.setattr(
            shm, name, lambda *a, real=real: (threads.append(threading.get_ident()), real(*a))[1]
        )
    c = open_server.client()
    sealed = SharedBuffer(PAGE)
    plain = memfd(PAGE, sealable=False)
    for bid in (
        sealed.register(c, "kv", 1, page_first_chunks(PAGE)),
        c.register_buffer("kv", PAGE, 1, page_first_chunks(PAGE), fd=plain),
    ):
        assert c.set("kv", [bid], bid, [0]) == [True] and c.get("kv", [bid], bid, [0]) == [True]
    assert len(threads) == 4 and loop_thread(open_server) not in threads


class HeldMapping:
    """Wraps a buffer's mapping: its copies wait on their thread until `release` is set."""

    def __init__(self, inner):
        self.inner, self.entered, self.release, self.calls = (
            inner,
            threading.Event(),
            threading.Event(),
            0,
        )
        self.addresses, self.sealed = inner.addresses, inner.sealed

    def run_plan(self, plan, into_engine):
        self.calls += 1
        self.entered.set()
        assert self.release.wait(60)
        return self.inner.run_plan(plan, into_engine)

    def close(self):
        self.inner.close()


def _stuck_tenant(url: str, steps) -> dict:
    """As uid nobody: a namespace, a buffer and a page; then (when told) a get that sticks."""
    c = SidecarClient(url, timeout=30)
    c.put_namespace("att", PAGE)
    c.put_page("att", "k", b"k" * PAGE)
    buf = SharedBuffer(PAGE)
    bid = buf.register(c, "att", 1, page_first_chunks(PAGE))
    steps.send(bid)
    steps.recv()
    out = {"get": c.get("att", ["k"], bid, [0])}
    out["bad"] = c.get_namespace("att")["buffers"][0]["bad"]
    out["again"] = c.get("att", ["k"], bid, [0])
    steps.send(out)
    steps.recv()
    return out


@root_only
def test_a_stuck_copy_costs_only_its_caller(make_server):
    """uid nobody's get sticks in its copy (held): past the copy deadline it answers false,
    its buffer is listed bad and later moves with it answer false at once, its page stays
    pinned until the copy really ends; this process's moves go on meanwhile."""
    srv = make_server(socket_mode=0o666, copy_deadline=0.5)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    c = srv.client(timeout=10)
    c.put_namespace("mine", PAGE)
    mine = SharedBuffer(PAGE)
    my_bid = mine.register(c, "mine", 1, page_first_chunks(PAGE))
    steps, child_steps = mp.get_context("fork").Pipe()
    tenant = Nobody(_stuck_tenant, srv.socket_url, child_steps)
    bid = steps.recv()
    held = srv.on_loop(lambda: srv.ns("att").buffers[bid])
    held.mapping = HeldMapping(held.mapping)
    steps.send("go")
    try:
        assert held.mapping.entered.wait(10)
        assert c.set("mine", ["x"], my_bid, [0]) == [True] and c.get(
            "mine", ["x"], my_bid, [0]
        ) == [True]
        assert steps.poll(30)
        seen = steps.recv()
        pins = srv.on_loop(lambda: srv.ns("att").pool.entries["k"].pins)
    finally:
        held.mapping.release.set()
    wait_for(lambda: srv.on_loop(lambda: srv.ns("att").pool.entries["k"].pins) == 0, 10)
    steps.send("done")
    tenant.result(30)
    assert seen["get"] == [False] and seen["again"] == [False] and "deadline" in seen["bad"]
    assert held.mapping.calls == 1 and pins == 1
    srv.invariants()


def test_registration_runs_off_the_loop_and_a_locked_memfd_answers_409(open_server, monkeypatch):
    """Sealing takes the memfd's inode lock, which its owner can hold (a long fallocate):
    the registration waits on an fd thread, answers 409 past FD_DEADLINE, and the mapping
    it makes later is closed and uncounted."""
    monkeypatch.setattr(leases, "FD_DEADLINE", 0.5)
    gate = Gate(shm, "_sealed", monkeypatch.setattr)
    closed = threading.Event()
    real_close = shm.ShmMapping.close
    monkeypatch.setattr(shm.ShmMapping, "close", lambda m: (real_close(m), closed.set()))
    c = open_server.client()
    buf = SharedBuffer(PAGE)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            status_of, lambda: buf.register(open_server.client(), "kv", 1, page_first_chunks(PAGE))
        )
        assert gate.entered.wait(10)
        assert c.health()["status"] == "ok"
        assert fut.result(30) == 409
    gate.open()
    assert closed.wait(10)
    quota = open_server.ctx.store.sources.quota
    wait_for(lambda: open_server.on_loop(lambda: quota.total_buffers) == 0, 10)
    assert open_server.on_loop(lambda: quota.total_mapped) == 0


def test_a_namespace_deleted_while_a_buffer_is_mapped(open_server, monkeypatch):
    """The namespace goes while its registration is on an fd thread: 404, and the buffer
    it mapped is closed and uncounted."""
    gate = Gate(shm, "_sealed", monkeypatch.setattr)
    c = open_server.client()
    buf = SharedBuffer(PAGE)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            status_of, lambda: buf.register(open_server.client(), "kv", 1, page_first_chunks(PAGE))
        )
        assert gate.entered.wait(10)
        c.delete_namespace("kv")
        gate.open()
        assert fut.result(30) == 404
    quota = open_server.ctx.store.sources.quota
    assert open_server.on_loop(lambda: (quota.total_buffers, quota.total_mapped)) == (0, 0)


# -- item 5: address space -------------------------------------------------------------
def test_only_what_the_chunks_cover_is_mapped(open_server):
    """A sparse 1 TiB memfd whose chunks use its last 4 pages maps those 4 pages."""
    c = open_server.client()
    size = 1 << 40
    fd = memfd(size)
    bid = c.register_buffer("kv", size, 4, page_first_chunks(PAGE, offset=size - 4 * PAGE), fd=fd)
    listed = next(b for b in c.get_namespace("kv")["buffers"] if b["buffer_id"] == bid)
    assert listed["mode"] == "mmap" and listed["mapped"] == 4 * PAGE
    c.put_page("kv", "p", b"p" * PAGE)
    assert c.get("kv", ["p"], bid, [3]) == [True] and os.pread(fd, PAGE, size - PAGE) == b"p" * PAGE
    quota = open_server.ctx.store.sources.quota
    assert open_server.on_loop(lambda: quota.total_mapped) == 4 * PAGE


def _register_mapped(url: str, pages: list[int]) -> list[int]:
    """As another uid: a namespace of its own, then one sealed buffer of each size."""
    c = SidecarClient(url)
    c.put_namespace("own", PAGE)
    return [
        status_of(lambda n=n: SharedBuffer(n * PAGE).register(c, "own", n, page_first_chunks(PAGE)))
        for n in pages
    ]


@root_only
def test_mapped_bytes_are_bounded_per_uid_and_in_all(make_server):
    srv = make_server(socket_mode=0o666, max_mapped_per_uid=16 * PAGE, max_mapped=24 * PAGE)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    c = srv.client()
    c.put_namespace("kv", PAGE)
    mine = SharedBuffer(16 * PAGE)
    bid = mine.register(c, "kv", 16, page_first_chunks(PAGE))
    assert (
        status_of(lambda: SharedBuffer(PAGE).register(c, "kv", 1, page_first_chunks(PAGE))) == 429
    )
    fd_mode = memfd(PAGE, sealable=False)  # maps nothing: not counted
    assert c.register_buffer("kv", PAGE, 1, page_first_chunks(PAGE), fd=fd_mode)
    assert as_nobody(_register_mapped, srv.socket_url, [8, 1]) == [200, 429]  # its share; then all
    c.release_buffer("kv", bid)
    assert SharedBuffer(PAGE).register(c, "kv", 1, page_first_chunks(PAGE))


def test_a_failed_mmap_is_the_callers_4xx(open_server, monkeypatch):
    def out_of_address_space(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    buf = SharedBuffer(PAGE)
    monkeypatch.setattr(shm.mmap, "mmap", out_of_address_space)
    c = open_server.client()
    assert status_of(lambda: buf.register(c, "kv", 1, page_first_chunks(PAGE))) == 429
    assert c.health()["status"] == "ok"
    quota = open_server.ctx.store.sources.quota
    assert open_server.on_loop(lambda: (quota.total_buffers, quota.total_mapped)) == (0, 0)


# -- item 10: one uid's share of buffers, leases, fd connections; idle lenders -----------------
def _register_n(url: str, n: int) -> list[int]:
    c = SidecarClient(url)
    c.put_namespace("own", PAGE)
    buf = SharedBuffer(PAGE)
    return [status_of(lambda: buf.register(c, "own", 1, page_first_chunks(PAGE))) for _ in range(n)]


@root_only
def test_buffers_leave_room_for_other_uids(open_server, monkeypatch):
    """One uid took every buffer (1,024) and the others got 429: now a uid holds its share."""
    monkeypatch.setattr(store, "MAX_BUFFERS_PER_UID", 3)
    monkeypatch.setattr(store, "MAX_BUFFERS", 5)
    c = open_server.client()
    buf = SharedBuffer(PAGE)
    for _ in range(3):
        buf.register(c, "kv", 1, page_first_chunks(PAGE))
    assert status_of(lambda: buf.register(c, "kv", 1, page_first_chunks(PAGE))) == 429
    assert as_nobody(_register_n, open_server.socket_url, 3) == [200, 200, 429]  # then all 5


def lend_code(c: SidecarClient) -> str:
    """Lend a new memfd: "l-" (a lease) or the error's code."""
    fd = memfd(PAGE)
    try:
        return c.lend_fd(fd)[:2]
    except SidecarError as exc:
        return exc.code
    finally:
        os.close(fd)


def _lend_n(url: str, n: int) -> list[str]:
    c = SidecarClient(url)
    return [lend_code(c) for _ in range(n)]


@root_only
def test_leases_leave_room_for_other_uids(open_server, monkeypatch):
    monkeypatch.setattr(leases, "MAX_LEASES_PER_UID", 2)
    monkeypatch.setattr(leases, "MAX_LEASES", 3)
    c = open_server.client()  # its leases last as long as its fd connection
    assert [lend_code(c) for _ in range(3)] == ["l-", "l-", "too_many_buffers"]
    assert as_nobody(_lend_n, open_server.socket_url, 2) == ["l-", "too_many_buffers"]


def closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(4096) == b""
    except ConnectionResetError:
        return True


@root_only
def test_fd_connections_leave_room_for_other_uids(make_server, monkeypatch):
    """256 idle connections of one uid stopped every other uid lending: now a uid holds at
    most its share (one more is closed at once, long before the idle timeout), and others
    still connect and lend."""
    monkeypatch.setattr(leases, "MAX_CONNECTIONS_PER_UID", 2)
    open_server = make_server(socket_mode=0o666, lend_idle_timeout=120)
    os.chmod(os.path.dirname(open_server.config.socket), 0o755)
    path = open_server.config.socket + ".fds"
    held = []
    for _ in range(3):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5)
        s.connect(path)
        held.append(s)
    assert closed_by_server(held[2])  # over this uid's share
    assert as_nobody(_lend_n, open_server.socket_url, 1) == ["l-"]


def test_idle_fd_connections_are_closed_and_lenders_stay(make_server):
    srv = make_server(lend_idle_timeout=1.0)
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    idle.settimeout(8)
    idle.connect(srv.config.socket + ".fds")
    lender = lend_frame(srv.config.socket, memfd(PAGE))
    assert b'"lease"' in lender.recv(4096)
    assert closed_by_server(idle)  # never, before
    lender.sendmsg(
        [leases.FRAME], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd(PAGE)]))]
    )
    assert b'"lease"' in lender.recv(4096)  # holding leases: it stays
