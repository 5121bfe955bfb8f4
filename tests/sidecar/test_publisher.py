"""What a subscriber or replay client that does not read can cost the sidecar
(sidecar/publisher.py): at most the batches its limits say, however long it sits there,
while the others get every batch. Memory is this process's RSS growth while 80 MB of
batches go out: what ZMQ queues for one that does not read (freed memory may stay in the
heap, so no test waits for RSS to fall)."""

from __future__ import annotations

import struct
import time

import pytest

from loadtest.kit.procs import free_port
from tests.conftest import replay_frames, wait_for

zmq = pytest.importorskip("zmq")
from sidecar.publisher import END_SEQ, Limits, Publisher  # noqa: E402  (the `events` extra)

BATCH = 400_000  # a heavy 20 ms batch (docs/kv-events.md, Cost)
MB = 2**20


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def stuck(kind: int, endpoint: str):
    """A socket that takes one message and then reads nothing (its kernel buffer small)."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def subscriber(endpoint: str, pub: Publisher):
    """A SUB that has joined: it gets what is sent from now on."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)

    def joined() -> bool:
        pub.send(b"hello", b"")
        return sock.poll(50) and bool(sock.recv_multipart())

    wait_for(joined)
    while sock.poll(200):
        sock.recv_multipart()
    return sock


def test_subscribers_that_do_not_read_hold_at_most_hwm_batches_and_the_rest_get_all():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = Publisher(endpoint, None, 0, 0, Limits(hwm=32))
    live = subscriber(endpoint, pub)
    dead = [stuck(zmq.SUB, endpoint) for _ in range(3)]
    try:
        wait_for(lambda: (pub.send(b"hello", b""), all(d.poll(50) for d in dead))[1])
        while live.poll(200):  # the hellos
            live.recv_multipart()
        before, payload, first = rss(), b"x" * BATCH, pub.seq
        for _ in range(200):  # 80 MB: the stuck ones would hold it all at vLLM's hwm
            assert pub.send(b"t", payload)
            assert live.poll(10_000)
            topic, seq, got = live.recv_multipart()
            assert (topic, len(got)) == (b"t", BATCH)
        assert int.from_bytes(seq, "big") == first + 199  # the live one: every batch
        assert rss() - before < 40 * MB, (rss() - before) / MB  # 32 batches shared: 13 MB
    finally:
        for sock in (live, *dead):
            sock.close(linger=0)
        pub.close()


def test_a_replay_client_that_does_not_read_is_given_up_and_the_next_is_served():
    replay = f"tcp://127.0.0.1:{free_port()}"
    limits = Limits(replay_hwm=50, stall=0.5, rate=1e12)
    pub = Publisher(f"tcp://127.0.0.1:{free_port()}", replay, 1000, 200 * BATCH, limits)
    dead = stuck(zmq.DEALER, replay)
    try:
        for _ in range(200):
            assert pub.send(b"t", b"x" * BATCH)
        before = rss()
        dead.send_multipart((b"", (0).to_bytes(8, "big")))  # all 80 MB, and read none
        wait_for(lambda: pub.replays_given_up == 1)
        assert rss() - before < 40 * MB, (rss() - before) / MB  # 50 batches queued: 20 MB
        got = replay_frames(replay)  # the thread serves the next client
        assert [int.from_bytes(seq, "big") for _, seq, _ in got] == list(range(200))
        assert (pub.replays, pub.replays_given_up) == (2, 1)
    finally:
        dead.close(linger=0)
        pub.close()


def test_a_replay_client_that_reads_slowly_is_given_up_once_it_kept_the_thread_waiting():
    """It reads 10 batches a second, so ZMQ frees queue slots in steps of 8 and no single
    wait is `stall` (1 s) long; the waits add up to it in a few seconds: given up."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = Publisher(
        f"tcp://127.0.0.1:{free_port()}",
        replay,
        1000,
        300 * BATCH,
        Limits(replay_hwm=16, stall=1.0, rate=100 * BATCH),
    )
    slow = zmq.Context.instance().socket(zmq.DEALER)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 4096)
    slow.connect(replay)
    try:
        for _ in range(300):
            assert pub.send(b"t", b"x" * BATCH)
        slow.send_multipart((b"", (0).to_bytes(8, "big")))
        got, t = 0, time.monotonic()
        while pub.replays_given_up == 0 and time.monotonic() - t < 30:
            if slow.poll(100):
                slow.recv_multipart()
                got += 1
            time.sleep(0.1)  # its pace: 10 batches a second
        assert pub.replays_given_up == 1 and got < 100, got
    finally:
        slow.close(linger=0)
        pub.close()


def test_a_replay_goes_no_faster_than_its_rate():
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = Publisher(f"tcp://127.0.0.1:{free_port()}", replay, 100, 1 << 30, Limits(rate=20 * BATCH))
    try:
        for _ in range(10):
            pub.send(b"t", b"x" * BATCH)
        t = time.monotonic()
        assert len(replay_frames(replay)) == 10
        assert time.monotonic() - t >= 0.4  # 10 batches at 20 a second: 0.5 s, paced by sleeps
    finally:
        pub.close()


# -- every subscriber together (issue 52, item 5) -------------------------------------------
def refused(pub: Publisher, key: str, more_than: int) -> None:
    """Wait until `pub` refused more than `more_than` handshakes on a socket."""
    wait_for(lambda: pub.stats()[key] > more_than)


def test_subscribers_past_the_cap_are_refused_and_one_gets_in_when_a_place_is_free():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = Publisher(endpoint, None, 0, 0, Limits(max_subscribers=2))
    first, second = subscriber(endpoint, pub), subscriber(endpoint, pub)
    late = zmq.Context.instance().socket(zmq.SUB)
    late.setsockopt(zmq.SUBSCRIBE, b"")
    late.connect(endpoint)
    try:
        refused(pub, "refused_subscribers", 0)
        refused(pub, "refused_subscribers", 1)  # it connects again, and again is refused
        for _ in range(20):
            assert pub.send(b"t", b"x" * 1000)
        for sock in (first, second):
            assert len([sock.recv_multipart() for _ in range(20)]) == 20
        assert not late.poll(300)  # past the cap: nothing queued to it, nothing sent
        first.close(linger=0)  # a place is free: the refused one's next try gets it
        wait_for(lambda: (pub.send(b"hello", b""), late.poll(50))[1])
        wait_for(lambda: pub.stats()["subscribers"] == 2)
    finally:
        for sock in (first, second, late):
            sock.close(linger=0)
        pub.close()


def test_a_replay_client_past_the_cap_is_refused_until_a_place_is_free():
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = Publisher(f"tcp://127.0.0.1:{free_port()}", replay, 100, 2**20, Limits(max_subscribers=1))
    holder = stuck(zmq.DEALER, replay)
    late = zmq.Context.instance().socket(zmq.DEALER)
    try:
        for _ in range(3):
            assert pub.send(b"t", b"x" * 100)
        holder.send_multipart((b"", (9).to_bytes(8, "big")))  # past the end: served, so in
        assert holder.poll(10_000) and holder.recv_multipart()[2] == END_SEQ
        late.connect(replay)
        late.send_multipart((b"", (0).to_bytes(8, "big")))  # kept on its side meanwhile
        refused(pub, "refused_replay_clients", 0)
        assert not late.poll(300) and pub.replays == 1  # the holder's
        holder.close(linger=0)
        assert late.poll(10_000)  # in at its next try: its request goes, it is served
        got = [late.recv_multipart() for _ in range(4)]
        assert [int.from_bytes(f[2], "big", signed=True) for f in got] == [0, 1, 2, -1]
    finally:
        for sock in (holder, late):
            sock.close(linger=0)
        pub.close()


def test_subscribers_that_stop_at_different_times_hold_the_budget_at_most_together():
    """The finding: each subscriber that stops reading holds the batches sent after it
    stopped, distinct from the others' (ZMQ shares a batch only among the queues it went
    to). Seven stop one after another while 150 batches of `batch_bytes` go out after each,
    a reading one beside them: before, each held its whole mark (256 batches: here the 150,
    37.5 MiB; seven, 262 MiB); now three are admitted with the reading one (the cap, 4),
    each holds `sndhwm` (46) batches, 34.5 MiB in all, the four others are refused and hold
    nothing (three holding the whole budget each: 112 MiB)."""
    limits = Limits()  # 4 subscribers, 64 MiB, batches of 256 KiB
    assert (limits.sndhwm, limits.held_bytes) == (46, limits.queue_bytes)
    endpoint, batch = f"tcp://127.0.0.1:{free_port()}", b"x" * limits.batch_bytes
    pub = Publisher(endpoint, None, 0, 0, limits)
    live = subscriber(endpoint, pub)
    dead: list = []

    def send(n: int) -> None:
        for _ in range(n):
            assert pub.send(b"t", batch)
            assert live.poll(10_000)
            topic, _, got = live.recv_multipart()
            assert (topic, len(got)) == (b"t", len(batch))

    try:
        send(100)  # the heap warm with batches of this size
        before, first = rss(), pub.seq
        for i in range(7):
            dead.append(stuck(zmq.SUB, endpoint))
            if i < 3:  # in: it has a batch (and then its queue fills)
                wait_for(lambda: (send(1), dead[-1].poll(0))[1])
            else:
                refused(pub, "refused_subscribers", pub.stats()["refused_subscribers"])
            send(150)
        grown = rss() - before
        assert not any(d.poll(0) for d in dead[3:])  # refused: nothing ever queued to them
        assert pub.seq - first >= 7 * 150
        assert grown < limits.queue_bytes + 16 * MB, grown / MB  # 3 x 46 batches: 35 MiB
    finally:
        for sock in (live, *dead):
            sock.close(linger=0)
        pub.close()


def test_admission_counts_every_open_connection_whatever_the_order():
    """`Door`: a handshake is admitted while the open connections, its own among them,
    are the cap at most; ACCEPTED and DISCONNECTED (fds, libzmq's monitor) say which are
    open. Two in their handshakes at once with one place: both refused, not both in."""
    from sidecar.publisher import ACCEPTED, DISCONNECTED, Door

    door = Door("PUB", 2, None)

    def event(kind: int, fd: int) -> None:
        door.event([struct.pack("=HI", kind, fd), b"tcp://127.0.0.1:1"])

    event(ACCEPTED, 10)
    assert door.admit()  # 10 in
    event(ACCEPTED, 11)
    event(ACCEPTED, 12)
    assert not door.admit() and not door.admit()  # 11 and 12 at once: 3 open, refused
    event(DISCONNECTED, 11)  # (libzmq closes a refused one at once)
    event(DISCONNECTED, 12)
    event(ACCEPTED, 11)  # fds come again
    assert door.admit()  # 11 in: 10 and 11 open
    event(ACCEPTED, 13)
    assert not door.admit() and door.refused == 3
    event(DISCONNECTED, 13)
    event(DISCONNECTED, 10)
    event(ACCEPTED, 10)
    assert door.admit() and door.open == {10, 11}
