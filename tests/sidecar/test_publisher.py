"""What a subscriber or replay client that does not read can cost the sidecar
(sidecar/publisher.py): at most the batches its limits say, however long it sits there,
while the others get every batch. Memory is this process's RSS growth while 80 MB of
batches go out: what ZMQ queues for one that does not read (freed memory may stay in the
heap, so no test waits for RSS to fall)."""

from __future__ import annotations

import time

import pytest

from loadtest.procs import free_port
from tests.conftest import replay_frames, wait_for

zmq = pytest.importorskip("zmq")
from sidecar.publisher import Limits, Publisher  # noqa: E402  (the `events` extra)

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
