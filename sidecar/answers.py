"""Inline pages' bytes: uploads (`PUT .../pages/{key}`) copied into their reserved slot as
they arrive, and answers (`GET .../pages/{key}`, issue 52 item 2) streamed from the pinned
slot, never copied whole. Before, each answer was a fresh copy of the page made on the
event loop, held until the client read it: 200 unread answers of 4 MiB pages held 800 MiB
for `--write-timeout`, and the copies stalled /healthz up to 1.7 s.
"""

from __future__ import annotations

import ctypes
from collections.abc import AsyncIterator, Iterator

from pools.page_pool import Entry, PagePool
from sidecar.ledger import Hold

ANSWER_PIECE = 32 * 2**10  # bytes an answer copies and sends at a time (one a loop turn)


async def fill_slot(address: int, body: AsyncIterator[bytes], size: int) -> int:
    """Copy an upload's body into the slot at `address`; the bytes it brought (more than
    `size` when it brought too many: nothing past `size` is written)."""
    got = 0
    async for chunk in body:
        n = len(chunk)
        if got + n > size:
            return got + n
        ctypes.memmove(address + got, chunk, n)
        got += n
    return got


class PageAnswer:
    """A pinned page going out inline: its bytes a piece at a time, then `close` (once;
    the pin and the ledger's hold given back).

        slot [-------------------- page_bytes --------------------]
              piece 0 | piece 1 | ...          (ANSWER_PIECE each, copied as sent)
    """

    __slots__ = ("pool", "entry", "hold", "address", "size")

    entry: Entry | None

    def __init__(self, pool: PagePool, entry: Entry, hold: Hold, address: int, size: int):
        self.pool, self.entry, self.hold = pool, entry, hold
        self.address, self.size = address, size

    def pieces(self) -> Iterator[bytes]:
        for off in range(0, self.size, ANSWER_PIECE):
            yield ctypes.string_at(self.address + off, min(ANSWER_PIECE, self.size - off))

    def close(self) -> None:
        entry, self.entry = self.entry, None
        if entry is not None:
            self.pool.unpin(entry)
            self.hold.release()
