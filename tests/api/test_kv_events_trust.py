"""KV events and other users of the node (issue 43, findings 3, 4, 7): the event sockets
take their own mode and group, not the engine socket's; token ids go out only when the
operator opts in; what a set may make an event carry is bounded in bytes; the collector
forgets the identities of deleted namespaces."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat

import msgspec
import orjson
import pytest

from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.as_uid import as_user
from sidecar import events as events_mod
from sidecar.config import Config
from sidecar.publisher import Limits
from tests.api.test_kv_events import PAGE, Subscriber, endpoints, settled
from tests.conftest import replay_frames, wait_for

zmq = pytest.importorskip("zmq")
NOBODY, ENGINES, ROUTERS = 65534, 4, 100  # uid nobody; groups adm and users


def _connect(path: str) -> str:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return "connected"
    except OSError as exc:
        return errno.errorcode[exc.errno]
    finally:
        s.close()


def _topics(endpoint: str) -> list:
    return [t for t, _, _ in replay_frames(endpoint)]


def _ipc(make_server, scratch, **extra):
    d = scratch(prefix="kvs-")
    os.chmod(d, 0o755)  # others may enter: only the sockets' mode keeps them out
    pub, rep = os.path.join(d, "pub"), os.path.join(d, "replay")
    srv = make_server(
        kv_events=f"ipc://{pub}",
        kv_events_replay=f"ipc://{rep}",
        kv_events_topic="t",
        socket_mode=0o660,
        socket_group="adm",
        **extra,
    )
    wait_for(lambda: srv.ctx.ready)
    c = srv.client()
    c.put_namespace("kv", PAGE, key_format="vllm")
    c.put_page("kv", f"{7:064x}", b"p" * PAGE)
    srv.on_loop(srv.ctx.events.flush)
    return srv, pub, rep


def test_event_sockets_are_the_sidecars_users_alone_by_default(make_server, scratch):
    """Default 0600: uid nobody in the engine socket's group (every tenant's engines) is
    refused on both; the sidecar's own user is served; the files go at exit."""
    srv, pub, rep = _ipc(make_server, scratch)
    for path in (pub, rep):
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert as_user(_connect, path, uid=NOBODY, groups=[ENGINES]) == "EACCES"
    assert _topics(f"ipc://{rep}") == [b"t@kv"]
    srv.stop()
    assert not os.path.lexists(pub) and not os.path.lexists(rep)


def test_event_sockets_take_the_group_the_operator_names(make_server, scratch):
    """`--kv-events-group users --kv-events-mode 0660`: a subscriber of another uid in that
    group reads the history; one in the engine socket's group alone is refused."""
    srv, pub, rep = _ipc(make_server, scratch, kv_events_group="users", kv_events_mode=0o660)
    for path in (pub, rep):
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == ROUTERS
        assert as_user(_connect, path, uid=NOBODY, groups=[ENGINES]) == "EACCES"
        assert as_user(_connect, path, uid=NOBODY, groups=[ROUTERS]) == "connected"
    assert as_user(_topics, f"ipc://{rep}", uid=NOBODY, groups=[ROUTERS]) == [b"t@kv"]


def _set_with_tokens(srv, page_tokens: int, tokens: list) -> tuple:
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE, key_format="vllm", page_tokens=page_tokens)
    buf = SharedBuffer(len(tokens) * PAGE)
    bid = buf.register(c, "kv", len(tokens), page_first_chunks(PAGE))
    keys = [f"{i + 1:064x}" for i in range(len(tokens))]
    body = {"keys": keys, "buffer_id": bid, "slots": list(range(len(keys))), "tokens": tokens}
    return c, keys, body


def _stored(payloads: list) -> list:
    return [
        e
        for p in payloads
        for e in msgspec.msgpack.decode(p)[1]
        if e["type"] == "BlockStored" and e["medium"] == "CPU_PINNED"
    ]


def test_token_ids_go_out_only_when_the_operator_opts_in(make_server):
    """Default: a set's tokens are checked but its BlockStored carries none (an empty
    list, which vLLM's BlockStored takes), on the PUB and in the replay."""
    port, replay = endpoints()
    srv = make_server(
        kv_events=f"tcp://127.0.0.1:{port}",
        kv_events_replay=f"tcp://127.0.0.1:{replay}",
        kv_events_topic="t",
    )
    wait_for(lambda: srv.ctx.ready)
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    seen = []
    real = srv.ctx.events.publisher.send
    srv.ctx.events.publisher.send = lambda topic, payload: (
        seen.append(bytes(payload)),
        real(topic, payload),
    )[1]
    try:
        c, keys, body = _set_with_tokens(srv, 2, [[11, 12], [13, 14]])
        assert c.request("POST", "/v1/namespaces/kv/set", {**body, "parent": "99" * 32})[1] == {
            "stored": [True, True]
        }
        settled(srv, sub)
    finally:
        sub.close()
    for got in (seen, [p for _, _, p in replay_frames(f"tcp://127.0.0.1:{replay}")]):
        assert [(e["block_hashes"], e["token_ids"], e["block_size"]) for e in _stored(got)] == [
            ([bytes.fromhex(k) for k in keys], [], 2)
        ]


def test_tokens_a_key_are_capped_at_the_namespaces_page_tokens(make_server):
    """More token ids than `page_tokens` for a key: 400, on /set and /v1/batch/set; 4,096
    at most where the namespace gives no page_tokens."""
    srv = make_server()
    c, keys, body = _set_with_tokens(srv, 4, [[1, 2, 3, 4], [5, 6, 7, 8, 9]])
    status, out = c.request("POST", "/v1/namespaces/kv/set", body, ok=(400,))
    assert status == 400 and "page_tokens" in orjson.loads(out)["error"]["message"]
    item = {"namespace": "kv", **body}
    assert c.request("POST", "/v1/batch/set", {"items": [item]}, ok=(400,))[0] == 400
    assert c.request("POST", "/v1/namespaces/kv/set", {**body, "tokens": [[1, 2, 3, 4], [5]]})[
        1
    ] == {"stored": [True, True]}
    c.put_namespace("free", PAGE)
    buf = SharedBuffer(PAGE)
    bid = buf.register(c, "free", 1, page_first_chunks(PAGE))
    one = {"keys": ["k"], "buffer_id": bid, "slots": [0]}
    assert (
        c.request("POST", "/v1/namespaces/free/set", {**one, "tokens": [[0] * 4097]}, ok=(400,))[0]
        == 400
    )
    assert c.request("POST", "/v1/namespaces/free/set", {**one, "tokens": [[0] * 4096]})[1] == {
        "stored": [True]
    }


def test_a_large_set_goes_out_in_batches_of_batch_bytes(make_server):
    """1,024 keys of 16 token ids of the largest width: every batch within
    `--kv-events-batch-bytes`; together they name every key, in order, with its tokens."""
    port, replay = endpoints()
    srv = make_server(
        kv_events=f"tcp://127.0.0.1:{port}",
        kv_events_replay=f"tcp://127.0.0.1:{replay}",
        kv_events_topic="t",
        kv_events_token_ids=True,
        kv_events_batch_bytes=2**16,
    )
    wait_for(lambda: srv.ctx.ready)
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    seen = []
    real = srv.ctx.events.publisher.send
    srv.ctx.events.publisher.send = lambda topic, payload: (
        seen.append(bytes(payload)),
        real(topic, payload),
    )[1]
    try:
        tokens = [[2**63 - 1 - i] * 16 for i in range(1024)]
        c, keys, body = _set_with_tokens(srv, 16, tokens)
        assert all(c.request("POST", "/v1/namespaces/kv/set", body)[1]["stored"])
        settled(srv, sub)
    finally:
        sub.close()
    assert len(seen) >= 3 and max(map(len, seen)) <= 2**16
    stored = _stored(seen)
    assert [h for e in stored for h in e["block_hashes"]] == [bytes.fromhex(k) for k in keys]
    assert [t for e in stored for t in e["token_ids"]] == [t for ts in tokens for t in ts]
    assert [e["parent_block_hash"] for e in stored[1:]] == [
        stored[i]["block_hashes"][-1] for i in range(len(stored) - 1)
    ]


def test_the_pub_queue_is_bounded_in_bytes(make_server):
    """The PUB's high-water mark: what `--kv-events-queue-bytes` holds for each of
    `--kv-events-max-subscribers` places (a subscriber's queue beside a replay client's 16
    batches and one batch in flight each, issue 52), never over `--kv-events-hwm`; a
    budget that leaves a subscriber under 32 batches is refused at start."""
    port, replay = endpoints()
    srv = make_server(
        kv_events=f"tcp://127.0.0.1:{port}",
        kv_events_replay=f"tcp://127.0.0.1:{replay}",
        kv_events_queue_bytes=2**23,
        kv_events_batch_bytes=2**16,
        kv_events_max_subscribers=1,
    )
    wait_for(lambda: srv.ctx.ready)
    assert srv.ctx.events.publisher.pub.getsockopt(zmq.SNDHWM) == 128 - 17 - 1
    assert srv.ctx.events.batch_bytes == 2**16
    assert Limits.of(Config()).sndhwm == 64 * 2**20 // (4 * 256 * 2**10) - 17 - 1
    assert Limits.of(Config()).held_bytes == Config().kv_events_queue_bytes
    assert Limits.of(Config(kv_events_queue_bytes=2**40)).sndhwm == 1000
    on = {"kv_events": f"tcp://127.0.0.1:{port}"}
    for bad in (
        {"kv_events_batch_bytes": 2**15},
        {"kv_events_queue_bytes": 2**17},
        {"kv_events_mode": 0o1777},
        {"kv_events_max_subscribers": 0},
        {**on, "kv_events_queue_bytes": 2**23, "kv_events_batch_bytes": 2**17},
    ):
        with pytest.raises(ValueError):
            Config(**bad)


def test_a_tcp_endpoint_is_announced_as_open_to_every_user(make_server, caplog):
    port, replay = endpoints()
    with caplog.at_level(logging.WARNING, logger="kv_sidecar.events"):
        srv = make_server(
            kv_events=f"tcp://127.0.0.1:{port}",
            kv_events_replay=f"tcp://127.0.0.1:{replay}",
            kv_events_token_ids=True,
        )
        wait_for(lambda: srv.ctx.ready)
    said = [r.getMessage() for r in caplog.records if "open to every user" in r.getMessage()]
    assert len(said) == 2 and all("token ids (the prompts)" in m for m in said)
    assert "every host that routes" in events_mod.open_endpoint("tcp://0.0.0.0:5557", False)


def test_identities_of_deleted_namespaces_are_forgotten(make_server):
    """A create-delete loop of namespaces of distinct identities: the collector's
    bookkeeping holds the live ones only."""
    port, replay = endpoints()
    srv = make_server(
        kv_events=f"tcp://127.0.0.1:{port}", kv_events_replay=f"tcp://127.0.0.1:{replay}"
    )
    wait_for(lambda: srv.ctx.ready)
    c = srv.client()
    c.put_namespace("stays", PAGE)
    for i in range(300):
        c.put_namespace(f"n{i}", PAGE)
        c.delete_namespace(f"n{i}")
    ev = srv.ctx.events

    def sizes() -> tuple:
        ev.flush()
        return len(ev.identities), len(ev.announced), len(ev.by_pool)

    assert srv.on_loop(sizes) == (1, 1, 1)
