"""The replay ring of KV events (sidecar/events.py `Publisher`): bounded by batches and by
bytes, the oldest dropped first; what it keeps is what the replay socket serves."""
from __future__ import annotations

import pytest

from loadtest.procs import free_port

zmq = pytest.importorskip("zmq")
from sidecar.events import END_SEQ, Publisher  # noqa: E402  (the `events` extra)


def replay_all(endpoint: str) -> list[int]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    seqs = []
    while True:
        assert sock.poll(10_000)
        _, _, seq, _ = sock.recv_multipart()
        if seq == END_SEQ:
            break
        seqs.append(int.from_bytes(seq, "big"))
    sock.close(linger=0)
    return seqs


@pytest.mark.parametrize("keep,keep_bytes,sizes,kept", [
    (3, 1 << 20, [4] * 6, [3, 4, 5]),          # by batches
    (100, 10, [4] * 6, [4, 5]),                # by bytes: 8 of 10
    (100, 10, [4, 4, 12], []),                 # a batch over the budget alone is not kept
    (100, 10, [12, 2, 3, 4], [1, 2, 3]),       # ... and the ring goes on after it
    (0, 10, [1, 1], []),                       # no replay at all
])
def test_the_ring_keeps_the_newest_batches_within_both_bounds(keep, keep_bytes, sizes, kept):
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = Publisher(f"tcp://127.0.0.1:{free_port()}", replay, keep, keep_bytes)
    try:
        for n in sizes:
            assert pub.send(b"t@ns", b"x" * n)
        assert [seq for seq, _, _ in pub.ring] == kept
        assert pub.ring_bytes == sum(len(p) for _, _, p in pub.ring) <= keep_bytes
        assert replay_all(replay) == kept
        assert pub.seq == len(sizes)
    finally:
        pub.close()
