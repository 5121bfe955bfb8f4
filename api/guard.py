"""Pure ASGI middleware in front of every route: TCP credentials, body size, request metrics.

The engine socket's callers are who the kernel says (SO_PEERCRED): no token is asked for
there, and one sent is not honoured (sidecar/credentials.py). On loopback TCP, once any
credential is configured, a request shows the operator's token or a tenant's (Bearer, or
HTTP Basic for a browser: user `sidecar` or the tenant's name) or is answered 401.
"""

from __future__ import annotations

import logging
import time

from api.errors import error_body
from sidecar.connections import CONN_KEY
from sidecar.credentials import TENANT_KEY, Credentials
from sidecar.errors import PayloadTooLarge
from sidecar.metrics import RequestStats
from sidecar.peer import PEER_KEY
from sidecar.tenancy import OPERATOR

log = logging.getLogger("kv_sidecar")
OPEN_PATHS = ("/healthz",)


class Guard:
    """Rejects unauthenticated (401) and oversized (413) requests before any route runs."""

    def __init__(self, app, credentials: Credentials, max_body: int, stats: RequestStats):
        self.app = app
        self.credentials = credentials
        self.max_body = max_body
        self.stats = stats
        self.warned = False  # an engine sent the operator's token on the engine socket

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
        if PEER_KEY in scope:  # the engine socket: the peer's credentials, never a token
            if auth is not None and not self.warned and self.credentials.role(auth) is OPERATOR:
                self.warned = True
                log.warning(
                    "an engine sent the operator's token on the engine socket, where no "
                    "token is needed or honoured: take it out of the engines' config"
                )
        elif self.credentials.guarded and scope["path"] not in OPEN_PATHS:
            conn = scope.get(CONN_KEY)  # a TCP connection yet to show a credential
            role = self.credentials.role(auth) if auth is not None else None
            if role is None:
                if conn is not None:
                    conn.unauthorized()  # closed once this answer is out
                return (
                    401,
                    "unauthorized",
                    "missing or wrong 'Authorization: Bearer <token>'",
                ), False
            if role is not OPERATOR:
                scope[TENANT_KEY] = role
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
