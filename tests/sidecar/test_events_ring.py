"""The replay ring of KV events (sidecar/publisher.py): bounded by batches and by
bytes, the oldest dropped first; what it keeps is what the replay socket serves."""

from __future__ import annotations

import pytest

from loadtest.kit.procs import free_port
from tests.conftest import replay_frames

zmq = pytest.importorskip("zmq")
from sidecar.publisher import Publisher  # noqa: E402  (the `events` extra)


@pytest.mark.parametrize(
    "keep,keep_bytes,sizes,kept",
    [
        (3, 1 << 20, [4] * 6, [3, 4, 5]),  # by batches
        (100, 10, [4] * 6, [4, 5]),  # by bytes: 8 of 10
        (100, 10, [4, 4, 12], []),  # a batch over the budget alone is not kept
        (100, 10, [12, 2, 3, 4], [1, 2, 3]),  # ... and the ring goes on after it
        (0, 10, [1, 1], []),  # no replay at all
    ],
)
def test_the_ring_keeps_the_newest_batches_within_both_bounds(keep, keep_bytes, sizes, kept):
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = Publisher(f"tcp://127.0.0.1:{free_port()}", replay, keep, keep_bytes)
    try:
        for n in sizes:
            assert pub.send(b"t@ns", b"x" * n)
        assert pub.ring.seqs() == kept
        assert pub.ring.bytes == sum(len(p) for _, _, p in pub.ring.since(0)) <= keep_bytes
        assert [int.from_bytes(seq, "big") for _, seq, _ in replay_frames(replay)] == kept
        assert pub.seq == len(sizes)
    finally:
        pub.close()
