"""Fault scenarios: a sidecar killed mid-run, and a tier that lies about what it holds."""

import hashlib
import random
import threading
import time

import pytest

from api.engine.client import SidecarClient, SidecarUnavailable
from api.engine.shm import SharedBuffer, page_first_chunks
from sidecar.tiers.file_tier import FileTier

PAGE = 16384


def data(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


QUEUE = 64  # --write-queue-pages: what a SIGKILL may lose of what `set` acknowledged


@pytest.mark.slow
def test_killed_sidecar_fails_fast_and_loses_at_most_the_write_queue(spawn, tmp_path):
    """SIGKILL mid-run: an acknowledged page is in the host pool and queued for the file
    tier, so after a restart every acknowledged page is served but those still in the write
    queue (at most --write-queue-pages). The kill waits for a count of acknowledged pages
    (many times the queue), not for a time: a loaded machine only takes longer."""
    args = (
        "--host-pool",
        "64MiB",
        "--data-dir",
        str(tmp_path / "data"),
        "--write-queue-pages",
        str(QUEUE),
    )
    p = spawn(*args).wait_ready()
    c = SidecarClient(p.socket_url, timeout=3)
    c.put_namespace("kv", PAGE)
    buf = SharedBuffer(16 * PAGE)
    bid = buf.register(c, "kv", 16, page_first_chunks(PAGE))
    acked, stop, enough = [], threading.Event(), threading.Event()

    def engine():
        i = 0
        while not stop.is_set():
            keys = [f"k{i}-{j}" for j in range(16)]
            for j, k in enumerate(keys):
                buf.view(j * PAGE, PAGE)[:] = data(k)
            try:
                stored = c.set("kv", keys, bid, list(range(16)))
            except SidecarUnavailable:
                return
            acked.extend(k for k, ok in zip(keys, stored, strict=True) if ok)
            if len(acked) >= 8 * QUEUE:
                enough.set()
            i += 1

    t = threading.Thread(target=engine)
    t.start()
    assert enough.wait(120), f"only {len(acked)} pages acknowledged in 120 s"
    p.kill()  # SIGKILL, no flush, writes in flight
    t0 = time.monotonic()
    try:
        c.exists("kv", ["k0-0"])
        raise AssertionError("a call to a dead sidecar must fail")
    except SidecarUnavailable:
        assert time.monotonic() - t0 < 3.5  # fails within its timeout, no hang
    stop.set()
    t.join(10)
    assert not t.is_alive()

    p2 = spawn(*args).wait_ready()
    c2 = SidecarClient(p2.socket_url, timeout=30)
    c2.put_namespace("kv", PAGE)  # the engine registers again
    out = SharedBuffer(16 * PAGE)
    oid = out.register(c2, "kv", 16, page_first_chunks(PAGE))
    served = 0
    for i in range(0, len(acked), 16):
        keys = acked[i : i + 16]
        loaded = c2.get("kv", keys, oid, list(range(len(keys))))
        for j, (k, ok) in enumerate(zip(keys, loaded, strict=True)):
            if ok:
                assert out.view(j * PAGE, PAGE) == data(k), f"{k}: wrong bytes"
                served += 1
    lost = len(acked) - served
    assert lost <= QUEUE, f"{lost} of {len(acked)} acknowledged pages lost (the queue is {QUEUE})"


class LyingTier(FileTier):
    """A seeded fault: reports chosen pages present, then fails their load after scribbling
    garbage into the destination slot."""

    def __init__(self, root, lies, seed):
        super().__init__("file", root)
        self.lies, self.rng = set(lies), random.Random(seed)

    def contains(self, identity, key):
        return key in self.lies or super().contains(identity, key)

    def read(self, identity, key, dst):
        if key in self.lies:
            dst[:] = bytes(self.rng.getrandbits(8) for _ in range(len(dst)))
            return False
        return super().read(identity, key, dst)


def test_lying_tier_gives_misses_never_wrong_bytes(server, client, tmp_path):
    client.put_namespace("kv", PAGE)
    keys = [f"p{i}" for i in range(12)]
    for k in keys[:6]:
        client.put_page("kv", k, data(k))
    lies = keys[6:]
    tier = LyingTier(str(tmp_path), lies, seed=7)
    tiering = server.ctx.store.tiering
    server.on_loop(lambda: tiering.tiers.append(tier))
    assert client.exists("kv", keys) == 12  # the tier claims the rest
    out = SharedBuffer(12 * PAGE)
    out.bytes.fill_(0xAB)
    oid = out.register(client, "kv", 12, page_first_chunks(PAGE))
    loaded = client.get("kv", keys, oid, list(range(12)))
    assert loaded == [True] * 6 + [False] * 6
    for i, k in enumerate(keys):
        got = out.view(i * PAGE, PAGE)
        assert got == (data(k) if i < 6 else b"\xab" * PAGE)  # untouched on a miss
    for k in lies:
        assert client.get_page("kv", k) is None
    server.invariants()
    server.on_loop(lambda: tiering.tiers.remove(tier))
