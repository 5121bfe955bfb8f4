"""Where a served request's time goes, as the connector sees it (issue 53): one JSON line a
step, a set and a request, appended to the file `kv_connector_extra_config["timeline"]`
names (off when unset: nothing is timed or kept). The engine writes it with its own rights,
where its operator points it, created 0600 and never through a symbolic link (a path in a
shared directory cannot be turned on another file); the sidecar never sees it. It holds
timings and counts only: no keys, no tokens.

    {"kind": "step",  "t": ..., "load_s", "load_pages", "save_s", "save_pages", "skipped"}
    {"kind": "set",   "t": ..., "set_s", "pages"}                     (the I/O thread's)
    {"kind": "request", "t": ..., "lookup_s", "late_steps", "hit_tokens", "prompt_tokens"}

`save_s` is what the step waited for the saves (copies into the staging memfd and waiting
for free staging slots); `skipped` pages found no free staging slot and were not saved;
`lookup_s` how long the scheduler held a request back for the sidecar's `exists` answer.
`loadtest.serving.trace_replay.breakdown` sums them per arm beside vLLM's own histograms.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

log = logging.getLogger("kv_sidecar.vllm")
FLUSH_ROWS = 64
FLUSH_S = 1.0  # a bench reads the file a level at a time
FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class Timeline:
    """Buffered JSON lines to one file; `add` never raises into the engine."""

    def __init__(self, path: str | None):
        self.path = path
        self._rows: list[str] = []
        self._lock = threading.Lock()
        self._flushed = time.monotonic()

    @property
    def on(self) -> bool:
        return self.path is not None

    def add(self, kind: str, **row: float | int) -> None:
        if self.path is None:
            return
        line = json.dumps({"kind": kind, "t": time.time(), **row})
        with self._lock:
            self._rows.append(line)
            if len(self._rows) < FLUSH_ROWS and time.monotonic() - self._flushed < FLUSH_S:
                return
            rows, self._rows, self._flushed = self._rows, [], time.monotonic()
        self._write(rows)

    def flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        self._write(rows)

    def _write(self, rows: list[str]) -> None:
        if not rows or self.path is None:
            return
        try:
            fd = os.open(self.path, FLAGS, 0o600)  # the engine's own, never through a link
            with os.fdopen(fd, "a") as f:
                f.write("\n".join(rows) + "\n")
        except OSError as exc:
            log.warning("kv-sidecar: timeline %s not written (%s): off", self.path, exc)
            self.path = None


OFF = Timeline(None)
