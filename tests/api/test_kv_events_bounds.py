"""What every subscriber of a sidecar's KV events may make it hold, together (issue 52,
item 5; sidecar/publisher.py): subscribers that stop reading one after another each hold
the batches sent after they stopped, so the PUB's queues were bounded per subscriber and
not in all (20 of them grew a sidecar by 324-391 MiB), and nothing capped how many
connect. Here a real `sidecar serve` publishes the largest events a set may make while
subscribers that never read join one at a time beside one that reads: the cap's worth
are admitted, the rest refused at their handshake (they receive nothing, and try again),
and the sidecar's RSS grows by less than `--kv-events-queue-bytes` and a stated slack."""

from __future__ import annotations

import threading

import pytest

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.procs import free_port
from sidecar.config import Config
from tests.conftest import wait_for

zmq = pytest.importorskip("zmq")
from zmq.utils.monitor import recv_monitor_message  # noqa: E402  (the `events` extra)

from sidecar.publisher import Limits  # noqa: E402

PAGE = 4096
MB = 2**20
CAP = Config().kv_events_max_subscribers  # 4: the reader and three that never read
BUDGET = Config().kv_events_queue_bytes  # 64 MiB: every connection's queue together
# what else the sidecar's RSS may grow by meanwhile: set bodies of 600 KB parsed, the
# heap's fragments of batches freed (the host pool and replay ring are warm before)
SLACK = 32 * MB
SETS = 150  # after each joins: ~200 batches of ~190 KB, more than a queue holds now (46)
# but not than it held before (256): there each of the seven held ~38 MB, 266 MB in all


def vmrss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


class Stuck:
    """A SUB that never reads (one message at most on its side, a 4 KiB kernel buffer),
    and what its monitor says of its connection: admitted (its handshake succeeded) or
    dropped during its handshake (refused: it connects again)."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self.sock.connect(endpoint)
        self.admitted = self.dropped = 0

    def seen(self) -> Stuck:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.admitted += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.dropped += 1
        return self

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class Reader:
    """A SUB that reads every batch (its own thread): the seqs it got."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.seqs: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                self.seqs.append(int.from_bytes(self.sock.recv_multipart()[1], "big"))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)


class Hog:
    """A tenant's sets of the largest events it may make: 7 keys of 4,096 token ids (the
    namespace's `page_tokens`) a set, ~260 KB of events (redteam_events `_largest_sets`)."""

    def __init__(self, url: str):
        self.c = SidecarClient(url, timeout=60)
        self.c.put_namespace("hog", PAGE, key_format="vllm", page_tokens=4096)
        self.buf = SharedBuffer(7 * PAGE)
        self.bid = self.buf.register(self.c, "hog", 7, page_first_chunks(PAGE))
        self.n, self.ids = 0, [2**63 - 1] * 4096

    def sets(self, count: int) -> None:
        for _ in range(count):
            keys = [f"{self.n * 7 + i + 1:064x}" for i in range(7)]
            body = {"keys": keys, "buffer_id": self.bid, "slots": list(range(7))}
            self.c.request("POST", "/v1/namespaces/hog/set", {**body, "tokens": [self.ids] * 7})
            self.n += 1

    def published(self) -> int:
        return self.c.request("GET", "/v1/stats")[1]["events"]["published"]


@pytest.mark.slow
def test_subscribers_past_the_cap_are_refused_and_all_hold_the_budget_at_most(spawn):
    assert Limits().held_bytes == BUDGET and Limits().max_subscribers == CAP
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = spawn(
        "--kv-events",
        endpoint,
        "--kv-events-replay",
        f"tcp://127.0.0.1:{free_port()}",
        "--kv-events-token-ids",
        "--host-pool",
        "4MiB",
        "--kv-events-buffer-bytes",
        "16MiB",
        "--no-file-tier",
    ).wait_ready()
    hog, reader, stuck = Hog(proc.socket_url), Reader(endpoint), []
    try:
        wait_for(lambda: (hog.sets(1), reader.seqs)[1])  # the reader is in
        hog.sets(200)  # the host pool full and evicting, the ring full, the heap warm
        before = peak = vmrss(proc.proc.pid)
        for i in range(CAP - 1 + 4):  # three join beside the reader, then four past the cap
            sub = Stuck(endpoint)
            stuck.append(sub)
            if i < CAP - 1:
                wait_for(lambda s=sub: s.seen().admitted == 1)
            else:  # dropped at its handshake, twice: refused, and refused again
                wait_for(lambda s=sub: s.seen().dropped >= 2)
            hog.sets(SETS)
            peak = max(peak, vmrss(proc.proc.pid))
        admitted, refused = stuck[: CAP - 1], stuck[CAP - 1 :]
        assert all(s.seen().admitted == 1 and s.sock.poll(0) for s in admitted)
        assert all(s.seen().admitted == 0 and not s.sock.poll(0) for s in refused)
        published = hog.published()  # the reader, within the cap, got every batch
        wait_for(lambda: reader.seqs[-1] == published - 1)
        assert reader.seqs == list(range(reader.seqs[0], published))
        assert peak - before < BUDGET + SLACK, (peak - before) / MB
    finally:
        for sub in stuck:
            sub.close()
        reader.close()
        hog.buf.close()
