"""Engine-shaped Locust users for the chaos soak (locust as a library, gevent greenlets).

Each user is one engine process on one namespace: its own memfd buffer lent over the engine
socket, conversations whose pages are `exists` -> `get` of the leading hit -> `set` of the
rest, in prefix order, plus inline PUT/GET of single pages and, now and then, a delete of a
finished conversation. Every answer goes to the ledger; every page served is checked against
its deterministic bytes. A sidecar that is down (restarting) is waited for, and the user
registers again (namespace, buffer) once it answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import gevent
from locust import User, constant, task

from api.engine.client import SidecarClient, SidecarError, SidecarUnavailable
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.chaos.ledger import Ledger

SLOTS = 48


@dataclass
class World:
    """What the users, the fault driver and the checks share (one gevent thread: no locks)."""

    ledger: Ledger
    page_bytes: int
    namespaces: dict  # name -> {"url": unix://..., "tcp": http://..., "node": Node}
    gen: dict = field(default_factory=dict)  # namespace -> generation (bumped on delete)
    counts: dict = field(
        default_factory=lambda: {
            "requests": 0,
            "unavailable": 0,
            "http_4xx": 0,
            "no_room_507": 0,
            "not_ready_503": 0,
            "gone_404": 0,
        }
    )
    errors: list = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def spec(self, ns: str) -> dict:
        if self.namespaces[ns].get("tenant"):  # the second tenant's, shared with our group
            return {"model": "chaos", "page_tokens": 16, "share_gid": os.getegid()}
        return {"model": "chaos", "page_tokens": 16}

    def engine_namespaces(self) -> list[str]:
        """The namespaces of this process's engines (Locust users): not the second tenant's."""
        return sorted(ns for ns, info in self.namespaces.items() if not info.get("tenant"))

    def failed(self, exc: SidecarError, what: str, node: str = "-") -> None:
        if exc.status == 503 and exc.code == "not_ready":
            self.counts["not_ready_503"] += 1  # starting or draining: the contract's answer
        elif exc.status >= 500:
            self.ledger.note(
                "http_5xx", f"{what}: {exc.status} {exc.code} {exc.message[:120]}", node=node
            )
        elif exc.status == 404:
            self.counts["gone_404"] += 1  # after a namespace delete or a restart
        elif exc.status == 507:
            self.counts["no_room_507"] += 1
        else:
            self.counts["http_4xx"] += 1
            if len(self.errors) < 20:
                self.errors.append(f"{what}: {exc.status} {exc.code} {exc.message[:120]}")


class ChaosEngine(User):
    """One engine on one namespace (assigned round-robin by `world`)."""

    abstract = True
    wait_time = constant(0.005)
    world: World = None
    _next = 0

    def on_start(self) -> None:
        names = self.world.engine_namespaces()
        ns = names[ChaosEngine._next % len(names)]
        ChaosEngine._next += 1
        self.ns, self.info = ns, self.world.namespaces[ns]
        self.client = SidecarClient(self.info["url"], timeout=20)
        self.buf = SharedBuffer(SLOTS * self.world.page_bytes, name="chaos-engine")
        self.bid: str | None = None
        self.serial = ChaosEngine._next * 1_000_000
        self.gen = -1

    def on_stop(self) -> None:
        self.client.close_leases()
        self.client.close()

    # -- plumbing ---------------------------------------------------------------------
    def _call(self, name: str, fn, *args):
        """Run one request; report it to Locust; None when it failed (and why is counted)."""
        w, start, exc, out = self.world, time.perf_counter(), None, None
        w.counts["requests"] += 1
        try:
            out = fn(*args)
        except SidecarUnavailable as e:
            w.counts["unavailable"] += 1
            self.bid, exc = None, e
        except SidecarError as e:
            if e.status == 404:
                self.bid = None  # the namespace or buffer is gone: register again
            w.failed(e, name, self.info["node"].name)
            exc = e if e.status >= 500 and e.code != "not_ready" else None
        self.environment.events.request.fire(
            request_type="chaos",
            name=name,
            response_time=(time.perf_counter() - start) * 1e3,
            response_length=0,
            exception=exc,
            context={},
        )
        return out

    def _setup(self) -> bool:
        try:
            self.client.put_namespace(self.ns, self.world.page_bytes, **self.world.spec(self.ns))
            chunks = page_first_chunks(self.world.page_bytes)
            self.bid = self.buf.register(self.client, self.ns, SLOTS, chunks)
            return True
        except (SidecarUnavailable, SidecarError, OSError):
            self.client.close_leases()
            gevent.sleep(0.2)
            return False

    def _conversation(self) -> None:
        self.gen = self.world.gen.get(self.ns, 0)
        self.serial += 1
        self.conv = f"g{self.gen}-c{self.serial}"
        self.keys = [f"g{self.gen}-sys-{i}" for i in range(4)]

    # -- tasks ------------------------------------------------------------------------
    @task(6)
    def turn(self) -> None:
        if self.bid is None and not self._setup():
            return
        if self.gen != self.world.gen.get(self.ns, 0) or len(self.keys) > SLOTS - 6:
            self._conversation()
        turn = len(self.keys)
        self.keys += [f"{self.conv}-{turn}-{i}" for i in range(1 + turn % 5)]
        keys = list(self.keys)
        hit = self._call("exists", self.client.exists, self.ns, keys)
        if hit is None:
            return
        if hit:
            loaded = self._call(
                "get", self.client.get, self.ns, keys[:hit], self.bid, list(range(hit))
            )
            if loaded is None:
                return
            for slot, ok in enumerate(loaded):
                if ok:
                    self.world.ledger.served(
                        self.ns,
                        keys[slot],
                        self.buf.view(slot * self.world.page_bytes, self.world.page_bytes),
                    )
        self._store(keys, hit)

    def _store(self, keys: list[str], hit: int) -> None:
        w, pb, todo = self.world, self.world.page_bytes, keys[hit:]
        if not todo:
            return
        for slot in range(hit, len(keys)):
            self.buf.view(slot * pb, pb)[:] = w.ledger.bytes_of(self.ns, keys[slot])
        durable = self.info["node"].policy == "write_through" and self.serial % 3 == 0
        body = {
            "keys": todo,
            "buffer_id": self.bid,
            "slots": list(range(hit, len(keys))),
            "durable": durable,
        }
        start = w.now()
        w.ledger.set_started(self.ns, todo, start)
        out = self._call("set", self.client.request, "POST", f"/v1/namespaces/{self.ns}/set", body)
        w.ledger.set_done(self.ns, todo, out[1]["stored"] if out else None, start, w.now(), durable)

    @task(2)
    def inline(self) -> None:
        if self.gen != self.world.gen.get(self.ns, 0):
            self._conversation()
        key = f"{self.conv}-inline-{self.serial % 7}"
        page = self._call("inline get", self.client.get_page, self.ns, key)
        if page is not None:
            self.world.ledger.served(self.ns, key, page)
            return
        w = self.world
        start = w.now()
        w.ledger.set_started(self.ns, [key], start)
        stored = self._call(
            "inline put", self.client.put_page, self.ns, key, w.ledger.bytes_of(self.ns, key)
        )
        w.ledger.set_done(self.ns, [key], None if stored is None else [True], start, w.now())

    @task(1)
    def finish(self) -> None:
        """End the conversation; one in four is deleted (its own pages, not the shared ones)."""
        if self.serial % 4 == 0 and self.gen == self.world.gen.get(self.ns, 0):
            mine = [k for k in self.keys if k.startswith(self.conv)] + [
                f"{self.conv}-inline-{i}" for i in range(7)
            ]
            w, start = self.world, self.world.now()
            if self._call("delete", self.client.delete, self.ns, mine) is not None:
                w.ledger.deleted(self.ns, mine, start, w.now())
            else:
                w.ledger.unknown(self.ns, mine)
        self._conversation()


class SecondTenant:
    """Another uid's engine on a sidecar (loadtest/chaos/tenant.py, a process of its own:
    uid nobody as root, in this process's group, which its namespace is shared with so the
    checks reach it). Its sets go to the ledger like the users' (read from its stdout)."""

    def __init__(self, soak, sp):
        w = soak.world
        self.ns, self.sets, self.acked, self.info = f"{sp.node.name}-t2", 0, 0, {}
        w.namespaces[self.ns] = {
            "url": sp.url,
            "tcp": sp.tcp,
            "node": sp.node,
            "proc": sp,
            "tenant": True,
        }
        w.ledger.owner[self.ns] = sp.node
        self.uid = 65534 if os.geteuid() == 0 else os.geteuid()
        cmd = [
            sys.executable,
            "-m",
            "loadtest.chaos.tenant",
            "--url",
            sp.url,
            "--ns",
            self.ns,
            "--seed",
            str(w.ledger.seed),
            "--page-bytes",
            str(w.page_bytes),
            "--t0",
            repr(w.t0),
            "--uid",
            str(self.uid),
            "--share-gid",
            str(os.getegid()),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.world = w
        self.reader = gevent.spawn(self._read)

    def _read(self) -> None:
        led = self.world.ledger
        for line in self.proc.stdout:
            ev = json.loads(line)
            if ev["ev"] == "start":
                led.set_started(self.ns, ev["keys"], ev["t"])
            elif ev["ev"] == "done":
                led.set_done(self.ns, ev["keys"], ev["stored"], ev["start"], ev["t"])
                self.sets += 1
                self.acked += sum(bool(x) for x in ev["stored"] or ())
            else:
                self.info = ev

    def stop(self) -> None:
        """Close its stdin (it stops after the set in flight) and read what it said last."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.reader.join(30)

    def describe(self) -> dict:
        return {
            "namespace": self.ns,
            "uid": self.info.get("uid", self.uid),
            "groups": self.info.get("groups"),
            "sets": self.sets,
            "acked_pages": self.acked,
        }
