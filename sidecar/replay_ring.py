"""The replay ring of KV events: the newest batches, for subscribers that ask to replay
from a sequence number (sidecar/publisher.py).

Payloads live in one anonymous mapping of `size` bytes, written round; an index (oldest
first) says where each is:

    mapping  | seq 7 | seq 8 | seq 9 |. head .| seq 4 | seq 5 | seq 6 |. waste .|
             0                       ^ the next batch goes here, or at 0 when it
                                       would not fit before the end (the end wasted)

A batch drops every older one its bytes cover, and the oldest go too while more than
`keep` batches are kept. A batch larger than the whole mapping is not kept, and all
before it go (nothing older may be replayed past a gap).

Why a mapping and not the payloads as bytes objects: a ring of 256 MiB of bytes in the
malloc heap spreads the sidecar's own allocations over memory gone cold, and a set slowed
with it (docs/kv-events.md, Cost). The mapping's pages are taken when it is made (`FLAGS`).

The loop writes (`add`) and the replay thread reads (`since`) under one lock, held for one
batch's copy at most, so a replay never holds the loop up for longer than that.
"""

from __future__ import annotations

import collections
import mmap
import threading
from collections.abc import Iterator

# private, and its pages taken now (MAP_POPULATE where the platform has it): the ring's
# memory is in the RSS from the start, and no first write of a batch takes a page fault
FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class ReplayRing:
    """`add(seq, topic, payload)` on the loop; `since(first)` from any thread."""

    def __init__(self, keep: int, size: int):
        self.keep, self.size = keep, size
        self.map: mmap.mmap | None = (
            mmap.mmap(-1, size, flags=FLAGS) if keep > 0 and size > 0 else None
        )
        self.index: collections.deque = collections.deque()  # (seq, topic, offset, length)
        self.head = 0  # where the next batch goes
        self.bytes = 0  # payload bytes kept
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    def seqs(self) -> list[int]:
        return [seq for seq, _, _, _ in self.index]

    def add(self, seq: int, topic: bytes, payload: bytes) -> None:
        n = len(payload)
        with self.lock:
            if self.map is None or n > self.size:
                self._drop(len(self.index))
                return
            start = self.head
            if start + n > self.size:  # wrap: what lies past the head is the oldest lap
                while self.index and self.index[0][2] >= start:
                    self._drop(1)
                start = 0
            while self.index and (
                len(self.index) >= self.keep or start <= self.index[0][2] < start + n
            ):
                self._drop(1)
            self.map[start : start + n] = payload
            self.index.append((seq, topic, start, n))
            self.head, self.bytes = start + n, self.bytes + n
            assert self.bytes <= self.size and len(self.index) <= self.keep

    def _drop(self, count: int) -> None:
        for _ in range(count):
            self.bytes -= self.index.popleft()[3]

    def since(self, first: int) -> Iterator[tuple[int, bytes, bytes]]:
        """(seq, topic, payload) of each kept batch from `first` on, copied out one at a
        time; one overwritten meanwhile is skipped (newer ones may still follow)."""
        with self.lock:
            wanted = [e for e in self.index if e[0] >= first]
        for seq, topic, offset, n in wanted:
            with self.lock:
                if self.map is None or not self.index or self.index[0][0] > seq:
                    continue
                payload = self.map[offset : offset + n]
            yield seq, topic, payload

    def close(self) -> None:
        with self.lock:
            if self.map is not None:
                self.map.close()
                self.map = None
            self._drop(len(self.index))
