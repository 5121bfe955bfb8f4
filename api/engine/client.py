"""The Python client engines import: one keep-alive HTTP/1.1 connection per thread.

Measured on loopback before choosing (an `exists` of 100 keys, 2-core VM): plain
`http.client` with keep-alive 763 us a call, `httpx.Client` 1,396 us (1.8x), a
`requests.Session` 1,803 us (2.4x). The client now frames HTTP/1.1 itself (one write a
request, Nagle off, Content-Length answers): `http.client` wrote head and body apart and
parsed headers with the email package, 2-3x a raw socket for an `exists` of 1,000 keys.

Engines should use the engine socket (`unix:///run/kv-sidecar/sidecar.sock`): only there can
they register shared memory, which the client does by lending the fd itself (SCM_RIGHTS on
`<socket>.fds`, see docs/security.md). Keep the client alive while its buffers are in use:
closing it (or exiting) ends the leases and the sidecar releases those buffers.
"""

from __future__ import annotations

import array
import http.client
import socket
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any
from urllib.parse import quote, urlsplit

import orjson

Body = bytes | bytearray | memoryview  # a request's body, sent as it is


class SidecarError(Exception):
    """An error answer: `status`, `code` and `message` from the error body of API.md."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class SidecarUnavailable(SidecarError):
    """The sidecar did not answer (not running, restarting, timed out)."""

    def __init__(self, message: str):
        super().__init__(0, "unavailable", message)


class _Connection:
    """One keep-alive HTTP/1.1 connection. A request goes out in one write with Nagle off
    (http.client writes head and body apart, and a delayed ACK then costs milliseconds);
    answers are framed by Content-Length, which every sidecar answer carries."""

    def __init__(self, address, timeout: float):
        self.address, self.timeout = address, timeout  # a Unix socket path or (host, port)
        self.sock: socket.socket | None = None
        self.buf = bytearray()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.buf.clear()

    def roundtrip(self, head: bytes, body: Body | None) -> tuple[int, bytes | bytearray]:
        if self.sock is None:
            self.sock = self._connect()
        if body is not None and memoryview(body).nbytes < _ONE_WRITE:
            self.sock.sendall(head + body)
        else:
            self.sock.sendall(head)
            if body is not None:
                self.sock.sendall(body)
        status, length, close = self._head()
        payload = self._take(length)
        if close:
            self.close()
        return status, payload

    def _connect(self) -> socket.socket:
        if isinstance(self.address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.address)
            except OSError:
                sock.close()
                raise
            return sock
        sock = socket.create_connection(self.address, self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _head(self) -> tuple[int, int, bool]:
        """(status, Content-Length, whether the server closes) of the next answer."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            self._fill()
        lines = self.buf[:end].decode("latin-1").split("\r\n")
        del self.buf[: end + 4]
        length, close = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection":
                close = value.strip().lower() == "close"
            elif name == "transfer-encoding":
                raise http.client.HTTPException(f"unexpected Transfer-Encoding {value.strip()}")
        return int(lines[0].split(" ", 2)[1]), length, close

    @property
    def _sock(self) -> socket.socket:
        """The socket `roundtrip` connected: answers are read inside it."""
        assert self.sock is not None, "an answer read outside a roundtrip"
        return self.sock

    def _fill(self) -> None:
        chunk = self._sock.recv(1 << 16)  # under malloc's mmap threshold: no mmap/munmap a call
        if not chunk:
            raise http.client.RemoteDisconnected("the sidecar closed the connection")
        self.buf += chunk

    def _take(self, n: int) -> bytes | bytearray:
        """The next n bytes; a large body as the bytearray it was read into (no copy)."""
        if len(self.buf) < n:  # a large body: one buffer, filled in place
            out, have = bytearray(n), len(self.buf)
            out[:have] = self.buf
            self.buf.clear()
            view = memoryview(out)
            while have < n:
                got = self._sock.recv_into(view[have:])
                if not got:
                    raise http.client.RemoteDisconnected("the sidecar closed mid-answer")
                have += got
            return bytes(out) if n < _ONE_WRITE else out
        small = bytes(self.buf[:n])
        del self.buf[:n]
        return small


_ONE_WRITE = 256 << 10
_RETRYABLE = (
    ConnectionResetError,
    BrokenPipeError,
    http.client.RemoteDisconnected,
    http.client.CannotSendRequest,
)
LEND_FRAME = b"LEND\n"
ENGINE_URL = (
    "unix:///run/kv-sidecar/sidecar.sock"  # the engine socket of a root sidecar / the image
)


class SidecarClient:
    """Every endpoint of API.md. Thread-safe: each thread has its own connection."""

    def __init__(
        self, url: str = "http://127.0.0.1:8411", token: str | None = None, timeout: float = 10.0
    ):
        parts = urlsplit(url)
        self.socket_path = parts.path if parts.scheme == "unix" and parts.path else None
        if self.socket_path is None and (parts.scheme != "http" or not parts.hostname):
            raise ValueError(
                f"sidecar url must be unix:///path/to/socket or http://host:port, got {url!r}"
            )
        self.host, self.port = parts.hostname, parts.port or 8411
        self.timeout = timeout
        self._lender: socket.socket | None = None
        self._lend_lock = threading.Lock()
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        host = f"{self.host}:{self.port}" if self.socket_path is None else "localhost"
        self._headers = f"Host: {host}\r\nContent-Type: application/json\r\n{auth}"
        self._local = threading.local()

    # -- transport --------------------------------------------------------------------
    def _conn(self) -> _Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = _Connection(self.socket_path or (self.host, self.port), self.timeout)
            self._local.conn = conn
        return conn

    def close(self) -> None:
        """Close this thread's connection (buffers stay; see `close_leases`)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def close_leases(self) -> None:
        """End every lease of this client: the sidecar releases the buffers they back."""
        with self._lend_lock:
            if self._lender is not None:
                self._lender.close()
                self._lender = None

    # -- lending file descriptors (the engine socket only) ----------------------------
    def lend_fd(self, fd: int) -> str:
        """Pass `fd` to the sidecar (SCM_RIGHTS) and return its lease id. The lease lives
        as long as this client's fd connection: a new one is opened after a restart."""
        if self.socket_path is None:
            raise SidecarError(
                0,
                "socket_required",
                "shared memory can be registered only "
                "over the engine socket: use a unix:///path sidecar url",
            )
        with self._lend_lock:
            for attempt in (0, 1):
                try:
                    return self._lend_locked(fd, self.socket_path)
                except (OSError, ValueError) as exc:
                    if self._lender is not None:
                        self._lender.close()
                        self._lender = None
                    if attempt:
                        raise SidecarUnavailable(f"lending an fd: {exc}") from exc
        raise AssertionError("unreachable")

    def _lend_locked(self, fd: int, path: str) -> str:
        if self._lender is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(self.timeout)
            try:
                sock.connect(path + ".fds")
            except OSError:
                sock.close()
                raise
            self._lender = sock
        self._lender.sendmsg(
            [LEND_FRAME], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        )
        reply = self._lender.recv(4096)
        if not reply:
            raise ConnectionResetError("the sidecar closed the fd socket")
        answer = orjson.loads(reply)
        if "error" in answer:
            raise SidecarError(400, answer["error"]["code"], answer["error"]["message"])
        return answer["lease"]

    def request(
        self, method: str, path: str, body: Any = None, raw: bool = False, ok: Sequence[int] = ()
    ) -> tuple[int, Any]:
        """(status, decoded body). Raises SidecarError for an error status not in `ok`."""
        data = (
            body
            if isinstance(body, (bytes, bytearray, memoryview)) or body is None
            else orjson.dumps(body)
        )
        for attempt in (0, 1):
            conn = self._conn()
            try:
                status, payload = conn.roundtrip(self._head(method, path, data), data)
                break
            except _RETRYABLE as exc:  # a stale keep-alive connection: reconnect once
                self.close()
                if attempt:
                    raise SidecarUnavailable(f"{method} {path}: {exc}") from exc
            except (TimeoutError, OSError, http.client.HTTPException) as exc:
                self.close()
                raise SidecarUnavailable(f"{method} {path}: {exc}") from exc
        if status >= 400 and status not in ok:
            try:
                err = orjson.loads(payload)["error"]
                raise SidecarError(status, err["code"], err["message"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise SidecarError(status, "http_error", payload[:200].decode("latin-1")) from None
        if raw or status >= 400:
            return status, payload
        return status, orjson.loads(payload) if payload else None

    def _head(self, method: str, path: str, data: Body | None) -> bytes:
        length = f"Content-Length: {memoryview(data).nbytes}\r\n" if data is not None else ""
        return f"{method} {path} HTTP/1.1\r\n{self._headers}{length}\r\n".encode("latin-1")

    @staticmethod
    @lru_cache(maxsize=1024)
    def _ns(name: str, tail: str = "") -> str:
        return f"/v1/namespaces/{quote(name, safe='')}{tail}"

    # -- process ----------------------------------------------------------------------
    def health(self) -> dict:
        return self.request("GET", "/healthz")[1]

    def ready(self) -> bool:
        try:
            return self.request("GET", "/readyz", ok=(503,))[0] == 200
        except SidecarUnavailable:
            return False

    def stats(self) -> dict:
        return self.request("GET", "/v1/stats")[1]

    def metrics(self) -> str:
        return self.request("GET", "/metrics", raw=True)[1].decode()

    # -- namespaces and buffers -------------------------------------------------------
    def put_namespace(self, name: str, page_bytes: int, **spec: Any) -> dict:
        return self.request("PUT", self._ns(name), {"page_bytes": page_bytes, **spec})[1]

    def get_namespace(self, name: str) -> dict:
        return self.request("GET", self._ns(name))[1]

    def list_namespaces(self) -> list[dict]:
        return self.request("GET", "/v1/namespaces")[1]["namespaces"]

    def delete_namespace(self, name: str) -> None:
        self.request("DELETE", self._ns(name))

    def register_buffer(
        self,
        namespace: str,
        size: int,
        slots: int,
        chunks: list[dict],
        transport: str = "shm",
        **where: Any,
    ) -> str:
        """Register engine memory: shm by `fd=` (lent to the sidecar, see `lend_fd`) or
        `path=`; cuda_ipc by `handle=` ... (see api.engine.cuda_export)."""
        if transport == "shm" and "fd" in where:
            fd = where.pop("fd")
            where.pop("pid", None)
            where["lease"] = self.lend_fd(fd)
        body = {"transport": transport, "size": size, "slots": slots, "chunks": chunks, **where}
        return self.request("POST", self._ns(namespace, "/buffers"), body)[1]["buffer_id"]

    def release_buffer(self, namespace: str, buffer_id: str) -> None:
        self.request("DELETE", self._ns(namespace, f"/buffers/{quote(buffer_id, safe='')}"))

    # -- pages ------------------------------------------------------------------------
    def exists(self, namespace: str, keys: Sequence[str]) -> int:
        return self.request("POST", self._ns(namespace, "/exists"), {"keys": keys})[1]["prefix"]

    def exists_where(self, namespace: str, keys: Sequence[str]) -> tuple[int, int, int]:
        """(prefix, host, local): the stored prefix, how much of it the host pool holds and
        how much the host pool or a local tier (the rest is on a remote tier)."""
        out = self.request("POST", self._ns(namespace, "/exists"), {"keys": keys, "where": True})[1]
        return out["prefix"], out.get("host", out["prefix"]), out.get("local", out["prefix"])

    def skipped(self, namespace: str, loads: int, pages: int) -> int:
        """Count restores the engine recomputed instead; the namespace's new total."""
        body = {"loads": loads, "pages": pages}
        return self.request("POST", self._ns(namespace, "/skipped"), body)[1]["restores_skipped"]

    def exists_each(self, namespace: str, keys: Sequence[str]) -> list[bool]:
        return self.request("POST", self._ns(namespace, "/exists?each=1"), {"keys": keys})[1][
            "present"
        ]

    def set(
        self,
        namespace: str,
        keys: Sequence[str],
        buffer_id: str,
        slots: Sequence[int],
        parent: str | None = None,
        tokens: Sequence[Sequence[int]] | None = None,
    ) -> list[bool]:
        """`parent` (the key before keys[0]) and `tokens` (each key's token ids) only feed the
        sidecar's KV events (docs/kv-events.md)."""
        body: dict = {"keys": keys, "buffer_id": buffer_id, "slots": slots}
        if parent is not None:
            body["parent"] = parent
        if tokens is not None:
            body["tokens"] = tokens
        return self.request("POST", self._ns(namespace, "/set"), body)[1]["stored"]

    def get(
        self, namespace: str, keys: Sequence[str], buffer_id: str, slots: Sequence[int]
    ) -> list[bool]:
        body = {"keys": keys, "buffer_id": buffer_id, "slots": slots}
        return self.request("POST", self._ns(namespace, "/get"), body)[1]["loaded"]

    def delete(self, namespace: str, keys: Sequence[str]) -> int:
        return self.request("POST", self._ns(namespace, "/delete"), {"keys": keys})[1]["deleted"]

    # -- several pools at once (hybrid models) ----------------------------------------
    def batch_exists(
        self, keys: Sequence[str], kv: str, extra: Sequence[dict] = (), restorable: bool = False
    ) -> dict:
        """{"hit", "kv", "pools"} (+ "restorable"); `extra` items: {"namespace", "policy", "window"}."""
        body = {
            "keys": keys,
            "kv": kv,
            "extra": list(extra),
            **({"restorable": True} if restorable else {}),
        }
        return self.request("POST", "/v1/batch/exists", body)[1]

    def batch_set(self, items: Sequence[dict]) -> dict[str, list[bool]]:
        """`items`: {"namespace", "keys", "buffer_id", "slots"} each; answers per namespace."""
        return self.request("POST", "/v1/batch/set", {"items": list(items)})[1]["stored"]

    def batch_get(self, items: Sequence[dict], kv: str | None = None) -> dict[str, list[bool]]:
        body = {"items": list(items), **({"kv": kv} if kv is not None else {})}
        return self.request("POST", "/v1/batch/get", body)[1]["loaded"]

    def put_page(self, namespace: str, key: str, data) -> bool:
        """Store one page inline; True when new, False when it was already present."""
        path = self._ns(namespace, f"/pages/{quote(key, safe='')}")
        return self.request("PUT", path, memoryview(data).cast("B"))[0] == 201

    def get_page(self, namespace: str, key: str) -> bytes | None:
        path = self._ns(namespace, f"/pages/{quote(key, safe='')}")
        status, payload = self.request("GET", path, raw=True, ok=(404,))
        return None if status == 404 else payload
