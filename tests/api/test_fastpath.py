"""The raw ASGI fast path answers exactly what the FastAPI routes answer, inside the Guard.

A query string sends a hot request to FastAPI instead (`?each=0` changes nothing else), so
the same body can be asked of both paths on one live server."""

import http.client

import orjson
import pytest

from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.unix_http import UnixHTTPConnection

PAGE = 4096


def post(server, path, body, headers=None, tcp=False):
    """On the engine socket, where the buffer's owner is known (or on loopback TCP)."""
    conn = (
        http.client.HTTPConnection("127.0.0.1", server.config.port, timeout=10)
        if tcp
        else UnixHTTPConnection(server.config.socket, 10)
    )
    conn.request("POST", path, body=body, headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, resp.getheader("content-type"), resp.read()
    conn.close()
    return out


@pytest.fixture
def buffer(client):
    client.put_namespace("kv", PAGE)
    client.put_namespace("mamba", PAGE, pool="mamba")
    buf = SharedBuffer(4 * PAGE)
    yield buf.register(client, "kv", 4, page_first_chunks(PAGE))
    buf.close()


def bodies(bid):
    keys = ["a", "b", "c"]
    move = {"keys": keys, "buffer_id": bid, "slots": [0, 1, 2]}
    return [
        ("/v1/namespaces/kv/set", move),
        ("/v1/namespaces/kv/get", move),
        ("/v1/namespaces/kv/exists", {"keys": keys}),
        (
            "/v1/batch/exists",
            {"keys": keys, "kv": "kv", "extra": [{"namespace": "mamba"}], "restorable": True},
        ),
        # errors: every status and code of these routes comes from the same handlers
        ("/v1/namespaces/kv/exists", {"keys": ["bad key"]}),
        ("/v1/namespaces/nope/exists", {"keys": keys}),
        ("/v1/namespaces/kv/set", {**move, "durable": 1}),
        ("/v1/namespaces/kv/get", {**move, "slots": [0, 9, 1]}),
        ("/v1/namespaces/kv/get", {**move, "slots": [0, True, 1]}),
        ("/v1/namespaces/kv/get", {**move, "slots": [0, -1, 1]}),
        ("/v1/namespaces/kv/set", {**move, "buffer_id": "nope"}),
        ("/v1/batch/exists", {"keys": keys}),
        ("/v1/batch/exists", {"keys": keys, "kv": "kv", "restorable": "yes"}),
        ("/v1/namespaces/kv/exists", [1]),
        ("/v1/namespaces/kv/exists", b"{"),
    ]


def test_fast_path_and_fastapi_answer_the_same_bytes(server, buffer):
    for path, body in bodies(buffer):
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        fast, slow = post(server, path, raw), post(server, path + "?each=0", raw)
        assert fast == slow, (path, body)
    statuses = {
        post(server, p, b if isinstance(b, bytes) else orjson.dumps(b))[0]
        for p, b in bodies(buffer)
    }
    assert statuses == {200, 400, 404, 422}


def test_fast_path_sits_inside_the_guard(make_server):
    server = make_server(token="s3cret", max_json_body=1024)
    auth = {"Authorization": "Bearer s3cret"}
    status, _, body = post(server, "/v1/namespaces/kv/exists", b'{"keys": []}', tcp=True)
    assert status == 401 and orjson.loads(body)["error"]["code"] == "unauthorized"
    status, _, body = post(
        server, "/v1/namespaces/kv/exists", b'{"keys": ["' + b"a" * 2000 + b'"]}', auth, tcp=True
    )
    assert status == 413 and orjson.loads(body)["error"]["code"] == "payload_too_large"
    client = server.client()
    client.put_namespace("kv", PAGE)
    assert client.exists("kv", ["a"]) == 0
    text = client.metrics()  # the Guard's metrics name the route template, as FastAPI's do
    assert 'route="/v1/namespaces/{name}/exists",status="200"' in text
    assert 'route="/v1/namespaces/{name}/exists",status="401"' not in text  # refused before routing


def test_answers_carry_no_server_banner(server):
    """The sidecar names no server software in its answers (uvicorn's `server` header off)."""
    conn = UnixHTTPConnection(server.config.socket, 10)
    conn.request("POST", "/v1/namespaces/nope/exists", body=b'{"keys": []}')
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 404 and resp.getheader("server") is None and resp.getheader("date")
    conn.close()
