"""Who a loopback TCP caller is: roles never share a secret (issue 52, item 1).

    listener       credential                          caller (sidecar/tenancy.py)
    engine socket  the peer's SO_PEERCRED (the kernel)  Peer(uid): a token is never
                                                        asked for nor honoured there
    loopback TCP   the operator's token                OPERATOR (every namespace)
                   a tenant's token (--tenant-tokens)  TcpTenant(name): its own only
                   none, when neither is configured    ANONYMOUS (one tenant for all)

Engines reach the sidecar on the engine socket, so they never hold the operator's token;
a tenant whose tools must use TCP gets a token of its own from the tenants file, which maps
to its own owner ("tcp:NAME"), never to the operator. Once any TCP credential is
configured, TCP without a valid one is 401 (only /healthz is open).

The tenants file: one `NAME TOKEN` a line (`#` comments and blank lines skipped), NAME of
1-64 letters, digits, `.`, `_` or `-`, TOKEN at least MIN_TOKEN characters; names and
tokens unique, none equal to the operator's token. It holds secrets: a file that group or
others may read (or a link) is refused at start. Tokens are looked up by their SHA-256
digest, so a comparison never runs over the secret's bytes one by one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import stat
from dataclasses import dataclass

from sidecar.tenancy import OPERATOR, Caller, TcpTenant

TENANT_KEY = "kv.tenant"  # where the Guard puts a TCP tenant in an ASGI scope
MIN_TOKEN = 16  # characters of a tenant's token at least
BROWSER_USER = "sidecar"  # HTTP Basic user for the operator's token (a browser's /ui login)
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


@dataclass(frozen=True, slots=True)
class Credentials:
    """The TCP listener's credentials: the operator's token and the tenants' tokens."""

    operator: bytes | None = None  # SHA-256 of the operator's token
    tenants: tuple[tuple[bytes, str], ...] = ()  # (SHA-256 of a token, tenant name)

    @classmethod
    def of(cls, operator_token: str | None, tenants_file: str | None) -> Credentials:
        tenants = read_tenants(tenants_file) if tenants_file else {}
        if operator_token is not None and operator_token in tenants:
            raise ValueError("a tenant's token equals the operator's: roles never share one")
        return cls(
            _digest(operator_token.encode()) if operator_token is not None else None,
            tuple((_digest(t.encode()), name) for t, name in tenants.items()),
        )

    @property
    def guarded(self) -> bool:
        """Whether TCP needs a credential (else TCP callers are the anonymous tenant)."""
        return self.operator is not None or bool(self.tenants)

    def role(self, authorization: bytes) -> Caller | None:
        """The role an Authorization header's value proves (Bearer TOKEN, or Basic with
        user `sidecar` for the operator / the tenant's name for a tenant), else None."""
        secret, user = _secret(authorization)
        if secret is None:
            return None
        digest = _digest(secret)
        if self.operator is not None and hmac.compare_digest(digest, self.operator):
            return OPERATOR if user in (None, BROWSER_USER) else None
        for known, name in self.tenants:
            if hmac.compare_digest(digest, known):
                return TcpTenant(name) if user in (None, name) else None
        return None


def _secret(authorization: bytes) -> tuple[bytes | None, str | None]:
    """(the secret, the Basic user or None for Bearer); (None, None) when malformed."""
    scheme, _, value = authorization.partition(b" ")
    if scheme.lower() == b"bearer" and value:
        return value.strip(), None
    if scheme.lower() == b"basic" and value:
        try:
            user, sep, secret = base64.b64decode(value.strip(), validate=True).partition(b":")
        except ValueError:
            return None, None
        if sep:
            return secret, user.decode("latin-1")
    return None, None


def read_tenants(path: str) -> dict[str, str]:
    """token -> tenant name from a private tenants file (module docstring); ValueError
    naming the line on anything else."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise ValueError(
                f"tenant tokens file {path} must be a regular file only its owner reads "
                f"(mode {stat.S_IMODE(st.st_mode):o}; chmod 600)"
            )
        text = os.read(fd, 1 << 20).decode()
    finally:
        os.close(fd)
    tenants: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, token = line.partition(" ")
        token = token.strip()
        if not _NAME.fullmatch(name) or len(token) < MIN_TOKEN or " " in token:
            raise ValueError(
                f"{path} line {n}: want `NAME TOKEN` (NAME 1-64 of [A-Za-z0-9._-], "
                f"TOKEN {MIN_TOKEN}+ characters, no spaces)"
            )
        if token in tenants or name in tenants.values():
            raise ValueError(f"{path} line {n}: a tenant or token named twice")
        tenants[token] = name
    return tenants
