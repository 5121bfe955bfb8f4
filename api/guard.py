"""Pure ASGI middleware in front of every route: bearer token, body size, request metrics."""

from __future__ import annotations

import base64
import hmac
import time

from api.errors import error_body
from sidecar.connections import CONN_KEY
from sidecar.errors import PayloadTooLarge
from sidecar.metrics import RequestStats

OPEN_PATHS = ("/healthz",)
BROWSER_USER = (
    b"sidecar"  # a browser may send the token as HTTP Basic: user `sidecar`, password TOKEN
)


class Guard:
    """Rejects unauthenticated (401) and oversized (413) requests before any route runs."""

    def __init__(self, app, token: str | None, max_body: int, stats: RequestStats):
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.basic = (
            b"Basic " + base64.b64encode(BROWSER_USER + b":" + token.encode()) if token else None
        )
        self.max_body = max_body
        self.stats = stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal, declared = self._refuse(scope)
            if refusal is not None:
                await _reply(send_counted, *refusal)
            else:  # a declared length within the limit bounds the body already
                await self.app(scope, receive if declared else self._limited(receive), send_counted)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.stats.observe(scope["method"], path, status[0], time.perf_counter() - start)

    def _refuse(self, scope) -> tuple[tuple[int, str, str] | None, bool]:
        """(a refusal or None, whether the body's length was declared within the limit)."""
        auth = length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"authorization":
                auth = value
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            conn = scope.get(CONN_KEY)  # a TCP connection yet to show the token
            assert self.basic is not None, "a token makes both forms (Bearer and Basic)"
            auth = auth or b""
            if not (
                hmac.compare_digest(auth, self.expected) or hmac.compare_digest(auth, self.basic)
            ):
                if conn is not None:
                    conn.unauthorized()  # closed once this answer is out
                return (
                    401,
                    "unauthorized",
                    "missing or wrong 'Authorization: Bearer <token>'",
                ), False
            if conn is not None:
                conn.authenticated()
        if length is not None:
            if not length.isdigit():
                return (400, "bad_request", "Content-Length is not a number"), False
            if int(length) > self.max_body:
                return (
                    413,
                    "payload_too_large",
                    f"body is over the limit of {self.max_body} bytes",
                ), False
            return None, True
        return None, False

    def _limited(self, receive):
        seen = [0]
        limit = self.max_body

        async def receive_limited():
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > limit:
                    raise PayloadTooLarge(f"body is over the limit of {limit} bytes")
            return message

        return receive_limited


async def _reply(send, status: int, code: str, message: str) -> None:
    body = error_body(code, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
        headers.append((b"www-authenticate", b'Basic realm="kv-sidecar"'))  # lets a browser log in
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
