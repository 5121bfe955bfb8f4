"""KV events (issue 31; sidecar/events.py): a subscriber that applies every event holds
exactly what the sidecar holds, per namespace and medium; the replay socket fills a late
subscriber; no event names a page that is not there.

The events are decoded generically here (msgpack); tests/engines/vllm/test_kv_events.py
decodes them with vLLM's own classes."""

from __future__ import annotations

import threading

import orjson
import pytest

from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.procs import free_port
from sidecar import events as events_mod
from sidecar.events import block_hash
from tests.conftest import replay_frames, wait_for

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
PAGE = 4096


class Subscriber:
    """SUB on the sidecar's endpoint; applies each batch to a model of what is held:
    {topic: {medium: set(block hash)}}."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.model: dict = {}
        self.last = -1
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                apply(self.model, topic, payload)
                self.last = int.from_bytes(seq, "big")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)


def apply(model: dict, topic: bytes, payload: bytes) -> None:
    _, events = msgspec.msgpack.decode(payload)[:2]
    held = model.setdefault(topic.decode(), {})
    for ev in events:
        kind = ev["type"] if isinstance(ev, dict) else ev[0]
        if kind == "AllBlocksCleared":
            held.clear()
            continue
        hashes, medium = (
            (ev["block_hashes"], ev["medium"])
            if isinstance(ev, dict)
            else (ev[1], ev[6] if kind == "BlockStored" else ev[2])
        )
        bucket = held.setdefault(medium, set())
        if kind == "BlockStored":
            bucket.update(hashes)
        else:
            bucket.difference_update(hashes)


def truth(srv, names: list[str]) -> dict:
    """What the sidecar holds, as the subscriber's model would say it (on the loop)."""

    def read():
        store, out = srv.ctx.store, {}
        tiers = store.tiering.tiers
        for name in names:
            ns = srv.ns(name)
            kf = ns.spec.key_format
            held = {"CPU_PINNED": {block_hash(k, kf) for k in ns.pool.ready}}
            for tier in tiers:
                held["DISK"] = {block_hash(k, kf) for k in tier.held_keys(ns.identity)}
            out[f"t@{name}"] = {m: s for m, s in held.items() if s}
        return out

    return srv.on_loop(read)


def settled(srv, sub: Subscriber) -> None:
    """Every event so far flushed (tier changes too: a flush takes a part of them),
    published and received."""
    events = srv.ctx.events

    def flushed():
        events.flush()
        return not events.tier_log and events.publisher.seq - 1 == sub.last

    wait_for(lambda: srv.on_loop(flushed))


def endpoints() -> tuple[int, int]:
    """Two free ports: the PUB and the replay socket (port + 1 may be another's)."""
    return free_port(), free_port()


@pytest.fixture
def evented(make_server, tmp_path):
    port, replay = endpoints()
    srv = make_server(
        file_tier=True,
        data_dir=str(tmp_path / "data"),
        kv_events=f"tcp://127.0.0.1:{port}",
        kv_events_replay=f"tcp://127.0.0.1:{replay}",
        kv_events_topic="t",
        write_queue_pages=8,
        kv_events_token_ids=True,
    )
    wait_for(lambda: srv.ctx.ready)
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    yield srv, sub, replay
    sub.close()


def model_of(sub: Subscriber, names: list[str]) -> dict:
    return {f"t@{n}": {m: s for m, s in sub.model.get(f"t@{n}", {}).items() if s} for n in names}


def test_a_subscriber_holds_what_the_sidecar_holds(evented):
    srv, sub, replay = evented
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE, key_format="vllm", page_tokens=4, host_capacity_bytes=16 * PAGE)
    c.put_namespace("other", PAGE, page_tokens=4)
    buf = SharedBuffer(8 * PAGE)
    bid = buf.register(c, "kv", 8, page_first_chunks(PAGE))
    wait_for(lambda: sub.sock is not None and srv.ctx.events is not None)
    keys = [f"{i:064x}" for i in range(40)]
    for r in range(5):  # 40 pages through 16 slots: evictions
        batch = keys[8 * r : 8 * r + 8]
        c.request(
            "POST",
            "/v1/namespaces/kv/set",
            {
                "keys": batch,
                "buffer_id": bid,
                "slots": list(range(8)),
                "parent": keys[8 * r - 1] if r else None,
                "tokens": [[4 * (8 * r + j) + t for t in range(4)] for j in range(8)],
            },
        )
    c.put_page("other", "plain-key", b"p" * PAGE)
    assert c.request("POST", "/v1/flush")[1]["pending"] == 0
    c.delete("kv", keys[30:32])
    settled(srv, sub)
    assert model_of(sub, ["kv", "other"]) == truth(srv, ["kv", "other"])
    late = replayed(replay)  # a subscriber that came late fills up by replay
    assert {k: {m: s for m, s in v.items() if s} for k, v in late.items() if k != ""} == {
        k: v for k, v in truth(srv, ["kv", "other"]).items()
    }
    c.delete_namespace("other")
    settled(srv, sub)
    assert sub.model["t@other"] == {}  # AllBlocksCleared
    srv.invariants()


def test_a_batch_that_cannot_be_encoded_is_counted_and_the_rest_go_on(evented):
    """A fault injected on purpose (no input is known to make one): an event msgspec cannot
    encode costs its topic's batch, counted, and no other batch nor any later flush."""
    srv, sub, _ = evented
    c = srv.client()
    c.put_namespace("kv", PAGE, key_format="vllm")
    wait_for(lambda: _probe_seen(srv, sub))  # the subscriber has joined
    events = srv.ctx.events
    srv.on_loop(lambda: events.pending.setdefault(b"t@bad", []).append(object()))
    c.put_page("kv", "ab" * 32, b"p" * PAGE)
    srv.on_loop(events.flush)
    assert srv.on_loop(lambda: (events.dropped, len(events.pending))) == (1, 0)
    c.put_page("kv", "cd" * 32, b"p" * PAGE)
    assert c.request("POST", "/v1/flush")[1]["pending"] == 0  # the file tier has both too
    settled(srv, sub)
    held = truth(srv, ["kv"])
    assert model_of(sub, ["kv"]) == held and len(held["t@kv"]["CPU_PINNED"]) == 2
    assert c.stats()["events"]["dropped"] == 1


def test_a_stored_chain_carries_its_parent_and_tokens(evented):
    srv, sub, _ = evented
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE, key_format="vllm", page_tokens=4)
    buf = SharedBuffer(3 * PAGE)
    bid = buf.register(c, "kv", 3, page_first_chunks(PAGE))
    seen = []
    real = srv.ctx.events.publisher.send
    srv.ctx.events.publisher.send = lambda topic, payload: (
        seen.append((topic, bytes(payload))),
        real(topic, payload),
    )[1]
    keys = ["aa" * 32, "bb" * 32, "cc" * 32]
    c.request(
        "POST",
        "/v1/namespaces/kv/set",
        {
            "keys": keys,
            "buffer_id": bid,
            "slots": [0, 1, 2],
            "parent": "99" * 32,
            "tokens": [[1, 2], [3], [4, 5]],
        },
    )
    settled(srv, sub)
    events = [e for _, payload in seen for e in msgspec.msgpack.decode(payload)[1]]
    host = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU_PINNED"]
    assert host == [
        {
            "type": "BlockStored",
            "block_hashes": [bytes.fromhex(k) for k in keys],
            "parent_block_hash": bytes.fromhex("99" * 32),
            "token_ids": [1, 2, 3, 4, 5],
            "block_size": 4,
            "lora_id": None,
            "medium": "CPU_PINNED",
            "lora_name": None,
        }
    ]


def test_a_set_with_a_key_present_before_stores_two_chains(evented):
    """A set's commits are logged as one entry; a key it did not store (present before)
    cuts the chain: each run is its own BlockStored, its parent the key before it."""
    srv, sub, _ = evented
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE, key_format="vllm", page_tokens=1)
    buf = SharedBuffer(4 * PAGE)
    bid = buf.register(c, "kv", 4, page_first_chunks(PAGE))
    keys = ["a1" * 32, "b2" * 32, "c3" * 32, "d4" * 32]
    c.request("POST", "/v1/namespaces/kv/set", {"keys": keys[1:2], "buffer_id": bid, "slots": [1]})
    settled(srv, sub)
    seen = []
    real = srv.ctx.events.publisher.send
    srv.ctx.events.publisher.send = lambda topic, payload: (
        seen.append(bytes(payload)),
        real(topic, payload),
    )[1]
    c.request(
        "POST",
        "/v1/namespaces/kv/set",
        {
            "keys": keys,
            "buffer_id": bid,
            "slots": [0, 1, 2, 3],
            "parent": "99" * 32,
            "tokens": [[1], [2], [3], [4]],
        },
    )
    settled(srv, sub)
    host = [
        (e["block_hashes"], e["parent_block_hash"], e["token_ids"])
        for p in seen
        for e in msgspec.msgpack.decode(p)[1]
        if e["type"] == "BlockStored" and e["medium"] == "CPU_PINNED"
    ]
    h = [bytes.fromhex(k) for k in keys]
    assert host == [([h[0]], bytes.fromhex("99" * 32), [1]), ([h[2], h[3]], h[1], [3, 4])]
    assert set(sub.model["t@kv"]["CPU_PINNED"]) == set(h)
    srv.invariants()


def replayed(port: int) -> dict:
    """Ask the replay socket for everything from seq 0; the model it rebuilds."""
    model: dict = {}
    for topic, _, payload in replay_frames(f"tcp://127.0.0.1:{port}"):
        apply(model, topic, payload)
    return model


def test_a_namespace_made_after_a_restart_announces_its_tier_pages(
    make_server, tmp_path, monkeypatch
):
    """The file tier kept pages across a restart: the namespace's first maker learns them
    as DISK pages (the host pool is empty), a part a flush (TIER_KEYS_A_FLUSH, 2 here:
    a million pages would otherwise be made events in one loop turn)."""
    monkeypatch.setattr(events_mod, "TIER_KEYS_A_FLUSH", 2)
    first = make_server(file_tier=True, data_dir=str(tmp_path / "data"))
    wait_for(lambda: first.ctx.ready)
    c = first.client()
    c.put_namespace("kv", PAGE, key_format="sglang")
    keys = [f"{i:016x}" + "f" * 48 for i in range(5)]  # SGLang reads the first 16 digits
    for k in keys:
        c.put_page("kv", k, b"k" * PAGE)
    assert c.request("POST", "/v1/flush")[1]["pending"] == 0
    first.stop()
    port, replay = endpoints()
    srv = make_server(
        file_tier=True,
        data_dir=str(tmp_path / "data"),
        kv_events_topic="t",
        kv_events=f"tcp://127.0.0.1:{port}",
        kv_events_replay=f"tcp://127.0.0.1:{replay}",
    )
    wait_for(lambda: srv.ctx.ready)
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        wait_for(lambda: _probe_seen(srv, sub))
        drained = []
        real = events_mod.Events._drain_tiers

        def counted(self):
            before = sum(len(e[1]) for e in self.tier_log) - self._tier_at
            real(self)
            drained.append(before - sum(len(e[1]) for e in self.tier_log) + self._tier_at)

        monkeypatch.setattr(events_mod.Events, "_drain_tiers", counted)
        srv.client().put_namespace("kv", PAGE, key_format="sglang")
        settled(srv, sub)
        assert sum(drained) == 5 and max(drained) == 2  # 5 pages, 2 a flush
        assert sub.model["t@kv"] == {"DISK": {block_hash(k, "sglang") for k in keys}}
        assert block_hash(keys[1], "sglang") == 1 and truth(srv, ["kv"]) == model_of(sub, ["kv"])
    finally:
        sub.close()


def _probe_seen(srv, sub: Subscriber) -> bool:
    """A namespace made and dropped until the subscriber has joined (a SUB misses what is
    published before it connects)."""
    c = srv.tcp_client()
    c.put_namespace("probe", PAGE)
    c.delete_namespace("probe")
    srv.on_loop(srv.ctx.events.flush)
    return "t@probe" in sub.model


def test_batches_go_out_by_themselves_every_gather(make_server):
    """No flush is called here: the loop's timer sends what `--kv-events-gather` gathered."""
    port, replay = endpoints()
    srv = make_server(
        kv_events=f"tcp://127.0.0.1:{port}",
        kv_events_replay=f"tcp://127.0.0.1:{replay}",
        kv_events_topic="t",
        kv_events_gather=0.01,
    )
    wait_for(lambda: srv.ctx.ready)
    assert srv.ctx.events.gather == 0.01
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    c = srv.client()
    c.put_namespace("kv", PAGE, key_format="vllm")
    keys = iter(f"{i:064x}" for i in range(10_000))
    try:

        def seen() -> bool:  # a SUB misses what went before it joined: store until one is seen
            c.put_page("kv", next(keys), b"p" * PAGE)
            return bool(sub.model.get("t@kv", {}).get("CPU_PINNED"))

        wait_for(seen)
        assert sub.model["t@kv"]["CPU_PINNED"] <= truth(srv, ["kv"])["t@kv"]["CPU_PINNED"]
    finally:
        sub.close()


def test_a_batch_gathers_the_loop_turns_of_its_gather(make_server):
    """Two sets, two loop turns, one batch: nothing goes out before `--kv-events-gather`
    (1 s here) has passed since the first event, then both go in batch 0."""
    port, replay = endpoints()
    srv = make_server(
        kv_events=f"tcp://127.0.0.1:{port}",
        kv_events_replay=f"tcp://127.0.0.1:{replay}",
        kv_events_topic="t",
        kv_events_gather=1.0,
    )
    wait_for(lambda: srv.ctx.ready)
    c, events = srv.client(), srv.ctx.events
    c.put_namespace("kv", PAGE, key_format="vllm")
    keys = [f"{i:064x}" for i in (1, 2)]
    for k in keys:
        c.put_page("kv", k, b"p" * PAGE)
    assert srv.on_loop(lambda: (events.publisher.seq, events.scheduled)) == (0, True)
    wait_for(lambda: srv.on_loop(lambda: events.publisher.seq) == 1)
    assert replayed(replay) == {"t@kv": {"CPU_PINNED": {bytes.fromhex(k) for k in keys}}}
    stats = c.request("GET", "/v1/stats")[1]["events"]
    assert stats["published"] == stats["replay_batches"] == 1 and stats["dropped"] == 0
    assert (stats["replays"], stats["replays_given_up"]) == (1, 0)
    assert (
        stats["replay_bytes"]
        == len(srv.on_loop(lambda: next(events.publisher.ring.since(0))[2]))
        > 0
    )


def test_parents_and_tokens_are_checked(make_server):
    srv = make_server()
    c = srv.client()
    c.put_namespace("kv", PAGE)
    buf = SharedBuffer(2 * PAGE)
    bid = buf.register(c, "kv", 2, page_first_chunks(PAGE))
    body = {"keys": ["a", "b"], "buffer_id": bid, "slots": [0, 1]}
    for bad in (
        {"tokens": [[1]]},
        {"tokens": [[1], ["x"]]},
        {"tokens": [[1], 2]},
        {"tokens": [[True], [1]]},
        {"tokens": [[1.5], [1]]},
        {"tokens": [[1], {"a": 1}]},
        {"parent": 7},
        {"parent": ""},
    ):
        status, out = c.request("POST", "/v1/namespaces/kv/set", {**body, **bad}, ok=(400,))
        assert status == 400 and orjson.loads(out)["error"]["code"] == "bad_request", bad
    assert c.request(
        "POST", "/v1/namespaces/kv/set", {**body, "parent": "z", "tokens": [[1, 2], []]}
    )[1] == {"stored": [True, True]}
