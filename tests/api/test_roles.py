"""Roles never share a secret (issue 52, item 1): the engine socket knows its caller by
SO_PEERCRED and never needs nor honours the operator's token; the operator's token is the
operator's; a TCP tenant's token (`--tenant-tokens`) maps to its own owner, never to the
operator's.

Before: with `--token-file` the engine socket demanded the operator's token, so every
tenant's engine held it; a tenant took it to loopback TCP and was the operator (it listed
another tenant's namespace, read its page, pinned it for 7 days and deleted it).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import os
import subprocess
import sys

import pytest

from api.engine.client import SidecarClient
from loadtest.kit.as_uid import as_user
from loadtest.kit.calls import status
from loadtest.kit.procs import free_port
from sidecar.credentials import Credentials, read_tenants
from sidecar.tenancy import OPERATOR, TcpTenant

PAGE = 4096
TOKEN = "operator-t0ken-of-the-node"
ALICE, BOB = "alice-t0ken-0123456789", "bob-t0ken-0123456789ab"
VICTIM, ATTACKER = 65534, 65532
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="other uids need root")


def page(tag: str) -> bytes:
    return hashlib.shake_256(tag.encode()).digest(PAGE)


def tenants_file(tmp_path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "tenants"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


@pytest.fixture
def two_tenants(tmp_path) -> str:
    return tenants_file(tmp_path, f"# TCP tenants\nalice {ALICE}\n\nbob {BOB}\n")


def _engine(url: str, token: str | None) -> dict:
    """An engine of its own uid on the engine socket, with or without a token."""
    c = SidecarClient(url, token=token)
    c.put_namespace("kv", PAGE, model="m")
    stored = c.put_page("kv", "own", page("own"))
    return {
        "stored": stored,
        "read": c.get_page("kv", "own") == page("own"),
        "victims": status(lambda: c.request("GET", "/v1/namespaces/kv@65534")),
        "listed": sorted(ns["name"] for ns in c.list_namespaces()),
    }


@root_only
def test_engines_need_no_token_and_the_operators_gains_them_nothing(make_server):
    """A root sidecar with the operator's token, its engine socket open to all: an engine
    of another uid works with no token at all, and one that sends the operator's token is
    still only its uid (no other tenant's namespace, by any name)."""
    srv = make_server(socket_mode=0o666, token=TOKEN)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    victim = as_user(_engine, srv.socket_url, None, uid=VICTIM)
    assert victim == {"stored": True, "read": True, "victims": 404, "listed": ["kv"]}
    attacker = as_user(_engine, srv.socket_url, TOKEN, uid=ATTACKER)
    assert attacker == {"stored": True, "read": True, "victims": 404, "listed": ["kv"]}
    # the operator on TCP sees both uids' namespaces: the token is the operator's there
    op = SidecarClient(srv.url, token=TOKEN)
    assert sorted(ns["owner"] for ns in op.list_namespaces()) == [ATTACKER, VICTIM]
    # and TCP without it is refused: the engines' socket took nothing from TCP's rule
    assert status(lambda: SidecarClient(srv.url).list_namespaces()) == 401
    srv.invariants()


def test_a_tenants_token_reaches_its_own_namespaces_only(make_server, two_tenants):
    """alice and bob on TCP with their own tokens: each a tenant with its own names; the
    operator's token still reaches every namespace; no tenant token is the operator."""
    srv = make_server(token=TOKEN, tenant_tokens_file=two_tenants)
    alice, bob = SidecarClient(srv.url, token=ALICE), SidecarClient(srv.url, token=BOB)
    op = SidecarClient(srv.url, token=TOKEN)
    op.put_namespace("ops", PAGE, model="m")
    made = alice.put_namespace("kv", PAGE, model="m")
    assert made["owner"] is None and made["name"] == "kv"
    alice.put_page("kv", "secret", page("secret"))
    # bob: its own "kv" is another namespace; alice's is nowhere to it
    assert [ns["name"] for ns in bob.list_namespaces()] == []
    bob.put_namespace("kv", PAGE, model="m")
    assert bob.get_page("kv", "secret") is None
    assert bob.put_namespace("kv", PAGE, model="m")["identity"] != made["identity"]
    for path in ("/v1/namespaces/kv@tcp:alice", "/v1/namespaces/ops"):
        assert status(lambda p=path: bob.request("GET", p)) == 404
    assert (
        status(lambda: bob.request("POST", "/v1/namespaces/kv@tcp:alice/pin", {"keys": ["secret"]}))
        == 404
    )
    assert status(lambda: bob.request("DELETE", "/v1/namespaces/ops")) == 404
    assert status(lambda: alice.put_namespace("g", PAGE, share_gid=4243)) == 403
    assert "ops" not in bob.metrics() and "ops" not in str(bob.stats())
    # the operator reaches both tenants' namespaces (by ref where the name is ambiguous)
    assert op.request("GET", "/v1/namespaces/kv@tcp:alice/pages/secret", raw=True)[1] == page(
        "secret"
    )
    assert sorted(ns["name"] for ns in alice.list_namespaces()) == ["kv"]
    # a wrong token, or a tenant's token offered as the operator's Basic login: 401
    assert status(lambda: SidecarClient(srv.url, token=ALICE + "x").list_namespaces()) == 401
    basic = base64.b64encode(b"sidecar:" + ALICE.encode()).decode()
    conn = http.client.HTTPConnection("127.0.0.1", srv.config.port, timeout=10)
    conn.request("GET", "/v1/namespaces", headers={"Authorization": f"Basic {basic}"})
    assert conn.getresponse().status == 401
    conn.close()
    srv.invariants()


def test_a_tenant_token_works_without_an_operator_token(make_server, two_tenants):
    """Tenants only: TCP without a tenant's token is 401 (no anonymous tenant), /healthz open."""
    srv = make_server(tenant_tokens_file=two_tenants)
    assert status(lambda: SidecarClient(srv.url).list_namespaces()) == 401
    conn = http.client.HTTPConnection("127.0.0.1", srv.config.port, timeout=10)
    conn.request("GET", "/healthz")
    assert conn.getresponse().status == 200
    conn.close()
    alice = SidecarClient(srv.url, token=ALICE)
    alice.put_namespace("kv", PAGE, model="m")
    assert [ns["name"] for ns in alice.list_namespaces()] == ["kv"]


def test_credentials_map_each_token_to_one_role(two_tenants):
    creds = Credentials.of(TOKEN, two_tenants)
    assert creds.role(b"Bearer " + TOKEN.encode()) is OPERATOR
    assert creds.role(b"Bearer " + ALICE.encode()) == TcpTenant("alice")
    assert creds.role(b"Basic " + base64.b64encode(b"bob:" + BOB.encode())) == TcpTenant("bob")
    assert creds.role(b"Basic " + base64.b64encode(b"alice:" + BOB.encode())) is None
    assert creds.role(b"Basic " + base64.b64encode(b"sidecar:" + TOKEN.encode())) is OPERATOR
    for bad in (b"", b"Bearer", b"Bearer wrong", b"Basic !!!", b"Token " + TOKEN.encode()):
        assert creds.role(bad) is None
    assert not Credentials.of(None, None).guarded


@pytest.mark.parametrize(
    "text, mode, why",
    [
        (f"alice {ALICE}\n", 0o644, "only its owner reads"),
        ("alice short\n", 0o600, "line 1"),
        (f"alice {ALICE}\nalice {BOB}\n", 0o600, "twice"),
        (f"al/ice {ALICE}\n", 0o600, "line 1"),
        (f"alice {TOKEN}\n", 0o600, "operator"),
    ],
)
def test_a_tenants_file_that_is_readable_or_malformed_is_refused(tmp_path, text, mode, why):
    path = tenants_file(tmp_path, text, mode)
    with pytest.raises(ValueError, match=why):
        Credentials.of(TOKEN, path)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(OSError):
        read_tenants(str(link))


def test_the_sidecar_does_not_start_on_a_readable_tenants_file(tmp_path):
    path = tenants_file(tmp_path, f"alice {ALICE}\n", 0o644)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--tenant-tokens",
            path,
            "--socket",
            "",
            "--port",
            str(free_port()),
            "--no-file-tier",
            "--host-pool",
            "16MiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "--tenant-tokens" in out.stderr, out.stderr[-2000:]
