"""Every 4xx of API.md, in the error shape, and nothing stored is lost by bad input."""

import hashlib
import http.client
import os
import socket

import orjson
import pytest

from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.unix_http import UnixHTTPConnection

PAGE = 4096


def raw(server, method, path, body=b"", headers=None, tcp=False):
    """A request the client would never send, on the engine socket (or loopback TCP);
    returns (status, decoded body)."""
    conn = (
        http.client.HTTPConnection("127.0.0.1", server.config.port, timeout=10)
        if tcp
        else UnixHTTPConnection(server.config.socket, 10)
    )
    hdrs = {"Content-Type": "application/json"}
    if server.config.token:
        hdrs["Authorization"] = f"Bearer {server.config.token}"
    hdrs.update(headers or {})
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    ctype = resp.getheader("content-type") or ""
    return resp.status, orjson.loads(data) if "json" in ctype else data


def raw_socket(server, data: bytes, unix: bool = False):
    """Send bytes as they are and read one response (the body may never be finished), on
    loopback TCP or the engine socket."""
    if unix:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(server.config.socket)
    else:
        sock = socket.create_connection(("127.0.0.1", server.config.port), timeout=10)
    with sock:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, orjson.loads(resp.read())


def assert_error(result, status, code):
    got_status, body = result
    assert got_status == status, body
    assert set(body) == {"error"} and body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.fixture
def ready(server, client):
    client.put_namespace("kv", PAGE)
    client.put_page("kv", "keep", hashlib.shake_256(b"keep").digest(PAGE))
    buf = SharedBuffer(4 * PAGE)
    bid = buf.register(client, "kv", 4, page_first_chunks(PAGE))
    yield bid
    # nothing stored was lost or corrupted by whatever the test sent
    assert client.get_page("kv", "keep") == hashlib.shake_256(b"keep").digest(PAGE)
    server.invariants()
    buf.close()


BAD_BODIES = [
    (b"not json", "bad_request"),
    (b"[1, 2]", "bad_request"),
    (b'{"keys": "abc"}', "bad_request"),
    (b'{"keys": [1, 2]}', "invalid_key"),
    (b'{"keys": ["a/b"]}', "invalid_key"),
    (b'{"keys": [""]}', "invalid_key"),
    (orjson.dumps({"keys": ["x" * 129]}), "invalid_key"),
    (b'{"keys": [null]}', "invalid_key"),
    (b"{}", "bad_request"),
]


@pytest.mark.parametrize("body,code", BAD_BODIES)
def test_400_malformed_exists_and_delete(server, ready, body, code):
    assert_error(raw(server, "POST", "/v1/namespaces/kv/exists", body), 400, code)
    assert_error(raw(server, "POST", "/v1/namespaces/kv/delete", body), 400, code)


@pytest.mark.parametrize(
    "extra,code",
    [
        ({"slots": "x"}, "bad_request"),
        ({"slots": [0, 1]}, "bad_request"),  # one slot per key
        ({"slots": [True]}, "bad_request"),
        ({"slots": [0.0]}, "bad_request"),
        ({"slots": [-1]}, "geometry_mismatch"),
        ({"slots": [1 << 20]}, "geometry_mismatch"),  # past the buffer's slots
        ({"buffer_id": 5}, "buffer_not_found"),
    ],
)
def test_400_malformed_set_get(server, ready, extra, code):
    body = orjson.dumps({"keys": ["a"], "buffer_id": ready, "slots": [0], **extra})
    status = {"buffer_not_found": 404, "geometry_mismatch": 422}.get(code, 400)
    for op in ("set", "get"):
        assert_error(raw(server, "POST", f"/v1/namespaces/kv/{op}", body), status, code)


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"page_bytes": 0},
        {"page_bytes": "4096"},
        {"page_bytes": 4096, "pool": "nope"},
        {"page_bytes": 4096, "rank": {"tp": 2, "tp_size": 2}},
        {"page_bytes": 4096, "bogus": 1},
        {"page_bytes": 4096, "replicated": "yes"},
        {"page_bytes": 4096, "host_capacity_bytes": -1},
        {"page_bytes": True},
        {"page_bytes": 1},
        {"page_bytes": 511},  # pages of 512 bytes at least
        {"page_bytes": 4096, "share_gid": -1},
        {"page_bytes": 4096, "share_gid": "kv"},
    ],
)
def test_400_bad_namespace_spec(server, ready, spec):
    assert_error(raw(server, "PUT", "/v1/namespaces/n2", orjson.dumps(spec)), 400, "bad_request")


def test_400_bad_names_and_query(server, ready):
    assert_error(
        raw(server, "PUT", "/v1/namespaces/" + "x" * 129, b'{"page_bytes": 1}'), 400, "bad_request"
    )
    assert_error(
        raw(server, "PUT", "/v1/namespaces/kv/pages/bad%20key", b"x" * PAGE), 400, "invalid_key"
    )
    assert_error(
        raw(server, "POST", "/v1/namespaces/kv/exists?each=maybe", b'{"keys": []}'),
        400,
        "bad_request",
    )


@pytest.mark.parametrize(
    "body",
    [
        {"transport": "tcp", "size": PAGE, "slots": 1, "chunks": []},
        {
            "transport": "shm",
            "size": PAGE,
            "slots": 1,
            "chunks": [{"offset": 0, "stride": 0}],
            "path": "/dev/shm/x",
        },
        {
            "transport": "shm",
            "size": PAGE,
            "slots": 1,
            "chunks": [{"offset": 0, "stride": PAGE, "size": PAGE}],
            "path": "/etc/passwd",
        },
        {
            "transport": "shm",
            "size": PAGE,
            "slots": 1,
            "chunks": [{"offset": 0, "stride": PAGE, "size": PAGE}],
            "path": "/dev/shm/a\u0000b",
        },
        {
            "transport": "shm",
            "size": PAGE,
            "slots": 1,
            "chunks": [{"offset": 0, "stride": PAGE, "size": PAGE}],
            "path": "/dev/shm/../etc/passwd",
        },
        {
            "transport": "shm",
            "size": PAGE,
            "slots": 1,
            "chunks": [{"offset": 0, "stride": PAGE, "size": PAGE}],
            "pid": 1,
            "fd": 99999,
        },
        {"transport": "shm", "size": 0, "slots": 1, "chunks": []},
        {
            "transport": "cuda_ipc",
            "size": PAGE,
            "slots": 1,
            "handle": "zz",
            "chunks": [{"offset": 0, "stride": PAGE, "size": PAGE}],
        },
        {
            "transport": "cuda_ipc",
            "size": PAGE,
            "slots": 1,
            "handle": "ab" * 64,
            "device_uuid": "nope",
            "chunks": [{"offset": 0, "stride": PAGE, "size": PAGE}],
        },
    ],
)
def test_400_bad_buffer_registration(server, ready, body):
    assert_error(
        raw(server, "POST", "/v1/namespaces/kv/buffers", orjson.dumps(body)), 400, "bad_request"
    )


@pytest.fixture
def operator_server(make_server):
    """A sidecar with a token: TCP callers are the operator, who reaches every namespace
    (tenancy), so what TCP may not do is refused by the buffer rules themselves."""
    return make_server(token="t0ken")


@pytest.fixture
def operator_ready(operator_server):
    c = operator_server.client()
    c.put_namespace("kv", PAGE)
    c.put_page("kv", "keep", hashlib.shake_256(b"keep").digest(PAGE))
    buf = SharedBuffer(4 * PAGE)
    yield buf.register(c, "kv", 4, page_first_chunks(PAGE))
    buf.close()


def test_pid_fd_registration_is_gone(operator_server, operator_ready, tmp_path):
    server = operator_server
    with open(tmp_path / "plain", "wb+") as f:
        f.truncate(PAGE)
        body = {
            "transport": "shm",
            "size": PAGE,
            "slots": 1,
            "pid": os.getpid(),
            "fd": f.fileno(),
            "chunks": [{"offset": 0, "stride": PAGE, "size": PAGE}],
        }
        assert_error(
            raw(server, "POST", "/v1/namespaces/kv/buffers", orjson.dumps(body)), 400, "bad_request"
        )
        assert_error(
            raw(server, "POST", "/v1/namespaces/kv/buffers", orjson.dumps(body), tcp=True),
            403,
            "forbidden",
        )


def test_403_and_404_for_memory_the_caller_does_not_own(operator_server, operator_ready):
    server, ready = operator_server, operator_ready
    shm = {
        "transport": "shm",
        "size": PAGE,
        "slots": 1,
        "path": "/dev/shm/x",
        "chunks": [{"offset": 0, "stride": PAGE, "size": PAGE}],
    }
    assert_error(
        raw(server, "POST", "/v1/namespaces/kv/buffers", orjson.dumps(shm), tcp=True),
        403,
        "forbidden",
    )
    lease = {**shm, "lease": "l-" + "0" * 32}
    del lease["path"]
    assert_error(
        raw(server, "POST", "/v1/namespaces/kv/buffers", orjson.dumps(lease)),
        404,
        "lease_not_found",
    )
    move = orjson.dumps({"keys": ["keep"], "buffer_id": ready, "slots": [0]})
    assert_error(
        raw(server, "POST", "/v1/namespaces/kv/get", move, tcp=True), 404, "buffer_not_found"
    )


def test_401_token(make_server):
    srv = make_server(token="s3cret")
    assert raw(srv, "GET", "/healthz")[0] == 200
    for hdr in ({"Authorization": "Bearer wrong"}, {"Authorization": ""}):
        assert_error(raw(srv, "GET", "/v1/stats", headers=hdr, tcp=True), 401, "unauthorized")
        assert_error(
            raw(srv, "PUT", "/v1/namespaces/a", b'{"page_bytes": 1}', headers=hdr, tcp=True),
            401,
            "unauthorized",
        )
    assert raw(srv, "GET", "/v1/stats", tcp=True)[0] == 200
    assert srv.client().stats()["namespaces"] == {}


def test_404s(server, ready):
    assert_error(
        raw(server, "POST", "/v1/namespaces/nope/exists", b'{"keys": []}'),
        404,
        "namespace_not_found",
    )
    assert_error(raw(server, "GET", "/v1/namespaces/kv/pages/absent"), 404, "key_not_found")
    assert_error(raw(server, "DELETE", "/v1/namespaces/kv/buffers/b-none"), 404, "buffer_not_found")
    assert_error(raw(server, "DELETE", "/v1/namespaces/nope"), 404, "namespace_not_found")
    assert_error(raw(server, "GET", "/v1/unknown"), 404, "not_found")
    assert_error(raw(server, "PATCH", "/v1/namespaces/kv"), 405, "method_not_allowed")


def test_409_conflicting_spec(server, ready):
    assert_error(raw(server, "PUT", "/v1/namespaces/kv", b'{"page_bytes": 8192}'), 409, "conflict")


def test_413_too_many_keys_and_body_limits(make_server):
    srv = make_server(max_body=1 << 20, max_json_body=64 * 1024)
    srv.client().put_namespace("kv", PAGE)
    keys = orjson.dumps({"keys": [f"k{i}" for i in range(4097)]})
    assert_error(raw(srv, "POST", "/v1/namespaces/kv/exists", keys), 413, "payload_too_large")
    big = orjson.dumps({"keys": ["k" * 100] * 1000})  # 100 KB > JSON limit
    assert_error(raw(srv, "POST", "/v1/namespaces/kv/exists", big), 413, "payload_too_large")
    # refused from the Content-Length alone, before the body is read
    head = b"PUT /v1/namespaces/kv/pages/a HTTP/1.1\r\nHost: x\r\nContent-Length: 2097152\r\n\r\n"
    assert_error(raw_socket(srv, head, unix=True), 413, "payload_too_large")
    # a chunked page body longer than page_bytes is cut off at once: 422
    chunk = b"x" * ((1 << 20) + 1)
    head = (
        b"PUT /v1/namespaces/kv/pages/a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(chunk)
        + chunk
        + b"\r\n"
    )
    assert_error(raw_socket(srv, head, unix=True), 422, "geometry_mismatch")
    assert srv.client().exists("kv", ["a"]) == 0
    srv.invariants()


def test_422_geometry(server, ready, client):
    chunk = [{"offset": 0, "stride": PAGE, "size": PAGE}]
    past = {"transport": "shm", "size": 2 * PAGE, "slots": 3, "chunks": chunk, "path": "/dev/shm/x"}
    assert_error(
        raw(server, "POST", "/v1/namespaces/kv/buffers", orjson.dumps(past)),
        422,
        "geometry_mismatch",
    )
    half = [{"offset": 0, "stride": PAGE, "size": PAGE // 2}]
    wrong = {"transport": "shm", "size": 4 * PAGE, "slots": 2, "chunks": half, "path": "/dev/shm/x"}
    assert_error(
        raw(server, "POST", "/v1/namespaces/kv/buffers", orjson.dumps(wrong)),
        422,
        "geometry_mismatch",
    )
    out = orjson.dumps({"keys": ["a"], "buffer_id": ready, "slots": [4]})
    assert_error(raw(server, "POST", "/v1/namespaces/kv/set", out), 422, "geometry_mismatch")
    neg = orjson.dumps({"keys": ["a"], "buffer_id": ready, "slots": [-1]})
    assert_error(raw(server, "POST", "/v1/namespaces/kv/get", neg), 422, "geometry_mismatch")
    assert_error(
        raw(server, "PUT", "/v1/namespaces/kv/pages/short", b"x" * (PAGE - 1)),
        422,
        "geometry_mismatch",
    )
    assert_error(
        raw(server, "PUT", "/v1/namespaces/kv/pages/long", b"x" * (PAGE + 1)),
        422,
        "geometry_mismatch",
    )
    assert client.exists_each("kv", ["a", "short", "long"]) == [False, False, False]
    too_big = orjson.dumps({"page_bytes": 1 << 30})
    assert_error(raw(server, "PUT", "/v1/namespaces/big", too_big), 422, "geometry_mismatch")


def test_507_no_room_and_false_for_set(server, ready, client):
    client.put_namespace("tiny", PAGE, host_capacity_bytes=2 * PAGE)
    buf = SharedBuffer(4 * PAGE)
    bid = buf.register(client, "tiny", 4, page_first_chunks(PAGE))
    client.put_page("tiny", "a", b"a" * PAGE)
    client.put_page("tiny", "b", b"b" * PAGE)
    # the host pool evicts LRU pages: no 507 while something is evictable
    assert client.set("tiny", ["c", "d", "e"], bid, [0, 1, 2]) == [True, True, False]
    assert_error(
        raw(
            server,
            "PUT",
            "/v1/namespaces/huge",
            orjson.dumps({"page_bytes": PAGE, "host_capacity_bytes": 1 << 30}),
        ),
        507,
        "no_room",
    )
    buf.close()


def test_413_chunked_body_counted_by_the_guard(make_server):
    srv = make_server(max_body=1 << 20, max_json_body=8 << 20)
    srv.client().put_namespace("kv", PAGE)
    chunk = b'{"keys": ["' + b"a" * (1 << 20) + b'"]}'
    head = (
        b"POST /v1/namespaces/kv/exists HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(chunk)
        + chunk
        + b"\r\n0\r\n\r\n"
    )
    assert_error(raw_socket(srv, head), 413, "payload_too_large")


def test_422_cuda_ipc_without_a_gpu(server, ready):
    from sidecar.transports.cuda_ipc import cuda_available

    if cuda_available():
        pytest.skip("a GPU is present")
    body = {
        "transport": "cuda_ipc",
        "size": PAGE,
        "slots": 1,
        "pid": 1,
        "handle": "ab" * 64,
        "device_uuid": "GPU-12345678-1234-1234-1234-123456789abc",
        "chunks": [{"offset": 0, "stride": PAGE, "size": PAGE}],
    }
    assert_error(
        raw(server, "POST", "/v1/namespaces/kv/buffers", orjson.dumps(body)),
        422,
        "transport_unavailable",
    )


def test_token_guards_every_route_but_healthz(make_server):
    """README: with a token, only /healthz answers without it on TCP. Every route the app
    has (and an unknown path), every method, with no Authorization header at all and with
    a wrong one: 401 on TCP before any route runs; never 401 on the engine socket, which
    knows its caller by SO_PEERCRED and takes no token (issue 52: engines hold none)."""
    import re

    srv = make_server(token="s3cret")
    routes = [
        (m.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, ops in srv.app.openapi()["paths"].items()
        for m in ops
    ]
    assert {"/metrics", "/readyz", "/v1/stats", "/healthz"} <= {p for _, p in routes}, routes
    routes += [("GET", p) for p in ("/openapi.json", "/docs", "/ui", "/v1/no-such-route")]
    for tcp in (True, False):
        for method, path in routes:
            for hdr in ({}, {"Authorization": "Bearer wrong"}):
                conn = (
                    http.client.HTTPConnection("127.0.0.1", srv.config.port, timeout=10)
                    if tcp
                    else UnixHTTPConnection(srv.config.socket, 10)
                )
                conn.request(method, path, body=b"{}", headers=hdr)
                resp = conn.getresponse()
                resp.read()
                conn.close()
                if tcp:
                    want = 200 if path == "/healthz" else 401
                    assert resp.status == want, (method, path, hdr, tcp, resp.status)
                else:
                    assert resp.status != 401, (method, path, hdr, resp.status)
    assert raw(srv, "GET", "/metrics")[0] == 200 and raw(srv, "GET", "/readyz")[0] == 200
