"""Engine-shaped load on a running sidecar (loopback only).

    locust -f loadtest/micro/locustfile.py --headless -u 8 -r 8 -t 60s \
        --host http://127.0.0.1:8411 --only-summary

Each user is an engine process with its own shm buffer, running multi-turn conversations
that share a system prompt: every turn is `exists`, `get` of the leading hit pages, `set`
of the rest (through the buffer), and one turn in five goes through the inline page
endpoints. Every loaded page is checked against its key, so a mixed-up page is a failure.
Locust exits 1 when any request failed.
"""

from __future__ import annotations

import hashlib
import os
import random
import time

from locust import User, between, task

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks

PAGE = int(os.environ.get("LOCUST_PAGE_BYTES", 64 * 1024))
SLOTS = 64
NAMESPACE = os.environ.get("LOCUST_NAMESPACE", "locust-kv")
SYSTEM = [hashlib.sha256(f"system-{i}".encode()).hexdigest() for i in range(4)]
TAG = 32  # bytes at the start of each page that identify its key


def tag(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class PageMixup(Exception):
    """A loaded page does not carry its key's bytes."""


class EngineUser(User):
    wait_time = between(0.0, 0.02)

    def on_start(self) -> None:
        self.client = SidecarClient(self.host, token=os.environ.get("SIDECAR_TOKEN"), timeout=30)
        self.client.put_namespace(NAMESPACE, PAGE, model="locust")
        self.buf = SharedBuffer(SLOTS * PAGE)
        self.bid = self.buf.register(self.client, NAMESPACE, SLOTS, page_first_chunks(PAGE))
        self.rng = random.Random(os.getpid() * 1000 + id(self) % 1000)
        self._new_conversation()

    def on_stop(self) -> None:
        try:
            self.client.release_buffer(NAMESPACE, self.bid)
        finally:
            self.client.close()

    def _new_conversation(self) -> None:
        self.conv = f"{self.rng.getrandbits(64):016x}"
        self.turns = 0
        self.keys = list(SYSTEM)

    def _measure(self, name: str, fn, *args):
        start, exc, result = time.perf_counter(), None, None
        try:
            result = fn(*args)
        except Exception as e:  # reported to Locust as a failure
            exc = e
        self.environment.events.request.fire(
            request_type="REST",
            name=name,
            response_time=(time.perf_counter() - start) * 1e3,
            response_length=0,
            exception=exc,
            context={},
        )
        if exc is not None:
            raise StopTurn()
        return result

    def _next_keys(self) -> list[str]:
        self.turns += 1
        self.keys += [f"{self.conv}-{self.turns}-{i}" for i in range(self.rng.randint(2, 6))]
        if len(self.keys) > SLOTS - 8:
            self._new_conversation()
            self.keys += [f"{self.conv}-0-{i}" for i in range(3)]
        return list(self.keys)

    @task(4)
    def turn_shm(self) -> None:
        try:
            keys = self._next_keys()
            hit = self._measure("exists", self.client.exists, NAMESPACE, keys)
            if hit:
                loaded = self._measure(
                    "get", self.client.get, NAMESPACE, keys[:hit], self.bid, list(range(hit))
                )
                self._measure("verify", self._verify, keys[:hit], loaded)
            if hit < len(keys):
                for slot in range(hit, len(keys)):
                    self.buf.view(slot * PAGE, TAG)[:] = tag(keys[slot])
                self._measure(
                    "set",
                    self.client.set,
                    NAMESPACE,
                    keys[hit:],
                    self.bid,
                    list(range(hit, len(keys))),
                )
        except StopTurn:
            pass

    @task(1)
    def turn_inline(self) -> None:
        try:
            key = f"{self.conv}-inline-{self.rng.randint(0, 3)}"
            page = self._measure("inline get", self.client.get_page, NAMESPACE, key)
            if page is not None and page[:TAG] != tag(key):
                self._measure("verify", self._fail, key)
            if page is None:
                data = tag(key) + bytes(PAGE - TAG)
                self._measure("inline put", self.client.put_page, NAMESPACE, key, data)
        except StopTurn:
            pass

    def _verify(self, keys: list[str], loaded: list[bool]) -> None:
        for slot, (key, ok) in enumerate(zip(keys, loaded, strict=True)):
            if ok and self.buf.view(slot * PAGE, TAG) != tag(key):
                raise PageMixup(f"slot {slot} does not hold {key}")

    def _fail(self, key: str) -> None:
        raise PageMixup(f"inline page {key} does not carry its key")


class StopTurn(Exception):
    """A request of this turn failed (already reported); skip the rest of the turn."""
