"""A one-line progress bar on stderr, drawn only when stderr is a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30


class Progress:
    """`update(n)` as work is done, `close()` at the end; silent unless `stream` is a tty."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.total, self.label = max(total, 1), label
        self.done = 0
        self.on = self.stream.isatty()
        self.start = self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.on and (now - self.last >= 0.1 or self.done >= self.total):
            self.last = now
            self.stream.write("\r" + self.line(now))
            self.stream.flush()

    def line(self, now: float) -> str:
        frac = min(self.done / self.total, 1.0)
        fill = int(frac * WIDTH)
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0.0
        return (
            f"{self.label} [{'#' * fill}{'.' * (WIDTH - fill)}] {self.done}/{self.total} "
            f"{frac:4.0%}  {rate:,.0f}/s  eta {eta:4.0f}s "
        )

    def close(self) -> None:
        if self.on:
            self.stream.write("\n")
            self.stream.flush()
