"""The sidecar's KV events decoded with vLLM's own classes (`vllm.distributed.kv_events`,
what a router built on vLLM's publisher parses), in both encodings (issue 31)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.procs import free_port
from tests.conftest import wait_for

PAGE = 4096


def collect(port: int, srv, act) -> list:
    """Subscribe, run `act()`, and return every (topic, payload) published meanwhile."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{port}")
    events = srv.ctx.events
    first = srv.on_loop(lambda: events.publisher.seq)
    wait_for(lambda: _joined(sock, srv))  # a SUB misses what is sent before it joins
    act()
    out, last = [], srv.on_loop(lambda: (events.flush(), events.publisher.seq)[1]) - 1
    while True:
        assert sock.poll(10_000)
        topic, seq, payload = sock.recv_multipart()
        if int.from_bytes(seq, "big") > first:
            out.append((topic, payload))
        if int.from_bytes(seq, "big") >= last:
            break
    sock.close(linger=0)
    return out


def _joined(sock, srv) -> bool:
    """Publish a probe (a namespace made and dropped) until the subscriber sees one."""
    c = srv.tcp_client()
    c.put_namespace("probe", PAGE)
    c.delete_namespace("probe")
    srv.on_loop(srv.ctx.events.flush)
    got = False
    while sock.poll(200):
        sock.recv_multipart()
        got = True
    return got


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_vllm_decodes_the_sidecars_events(make_server, tmp_path, fmt):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    port = free_port()
    srv = make_server(
        kv_events=f"tcp://127.0.0.1:{port}",
        kv_events_format=fmt,
        kv_events_topic="node",
        kv_events_replay=f"tcp://127.0.0.1:{free_port()}",
        kv_events_token_ids=True,
    )
    wait_for(lambda: srv.ctx.ready)
    c = srv.client()
    keys = ["11" * 32, "22" * 32]

    def act():
        c.put_namespace("kv", PAGE, key_format="vllm", page_tokens=16)
        buf = SharedBuffer(2 * PAGE)
        bid = buf.register(c, "kv", 2, page_first_chunks(PAGE))
        c.request(
            "POST",
            "/v1/namespaces/kv/set",
            {
                "keys": keys,
                "buffer_id": bid,
                "slots": [0, 1],
                "tokens": [list(range(16)), list(range(16, 32))],
            },
        )
        c.delete("kv", keys[1:])
        c.delete_namespace("kv")

    got = collect(port, srv, act)
    assert {t for t, _ in got} == {b"node@kv"}
    payloads = [p for _, p in got]
    if fmt == "map":  # vLLM's own decoder: tagged structs in an array-like batch
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        events = [e for p in payloads for e in decoder.decode(p).events]
    else:  # positional: the same fields, in vLLM's order, after the tag
        events = [_positional(e) for p in payloads for e in msgspec.msgpack.decode(p)[1]]
    stored, removed, cleared = events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [
        bytes.fromhex(k) for k in keys
    ]
    assert stored.token_ids == list(range(32)) and stored.block_size == 16
    assert stored.medium == "CPU_PINNED" and stored.parent_block_hash is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [bytes.fromhex(keys[1])]
    assert isinstance(cleared, AllBlocksCleared)


def _positional(raw: list):
    """An array-encoded event back into vLLM's classes, by position."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    kind, *fields = raw
    cls = {
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
    }[kind]
    names = {
        "BlockStored": [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
        ],
        "BlockRemoved": ["block_hashes", "medium"],
        "AllBlocksCleared": [],
    }[kind]
    return cls(**dict(zip(names, fields, strict=False)))  # trailing defaults may be left off
