"""Namespaces have owners (issue 26, item 9; sidecar/tenancy.py).

A root sidecar, two tenants as child processes of other uids on its engine socket (0666
here: the worst case), the operator on TCP behind a token. Each tenant reaches its own
namespaces, and those shared with one of its groups; to it every other namespace does not
exist (404 on every route, absent from listings and stats), and a name another tenant took
first is still its own to create.
"""

import hashlib
import os

import pytest

from api.engine.client import SidecarClient, SidecarError
from loadtest.kit.as_uid import as_user
from loadtest.kit.calls import status
from tests.conftest import wait_for

PAGE = 4096
A, B = 65534, 65532  # two tenants' uids (gid = uid, no other groups)
TOKEN = "op-t0ken"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="tenants of other uids need root")


def page(tag: str) -> bytes:
    return hashlib.shake_256(tag.encode()).digest(PAGE)


def read(c: SidecarClient, ns: str, key: str) -> bytes:
    """GET a page; a 404 raises (the client's get_page answers None for it)."""
    return c.request("GET", f"/v1/namespaces/{ns}/pages/{key}", raw=True)[1]


@pytest.fixture
def node(make_server):
    srv = make_server(socket_mode=0o666, token=TOKEN)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    return srv


def _tenant_a(url: str) -> dict:
    c = SidecarClient(url, token=TOKEN)
    c.put_namespace("kv", PAGE)
    c.put_page("kv", "k", page("a"))
    c.put_namespace("team", PAGE, share_gid=B)
    c.put_page("team", "t", page("team"))
    return {ns["name"]: ns for ns in c.list_namespaces()}


def _tenant_b_probes(url: str) -> dict:
    """What B sees of A's namespace "kv" before making its own, on every route."""
    c = SidecarClient(url, token=TOKEN)
    probes = {
        "get_ns": lambda: c.get_namespace("kv"),
        "exists": lambda: c.exists("kv", ["k"]),
        "exists_each": lambda: c.exists_each("kv", ["k"]),
        "get_page": lambda: read(c, "kv", "k"),
        "put_page": lambda: c.put_page("kv", "planted", page("evil")),
        "delete_keys": lambda: c.request("POST", "/v1/namespaces/kv/delete", {"keys": ["k"]}),
        "prefetch": lambda: c.request("POST", "/v1/namespaces/kv/prefetch", {"keys": ["k"]}),
        "buffers": lambda: c.request("GET", "/v1/namespaces/kv/buffers"),
        "batch_exists": lambda: c.batch_exists(["k"], "kv", []),
        "delete_ns": lambda: c.delete_namespace("kv"),
    }
    out = {name: status(fn) for name, fn in probes.items()}
    # a member joins the namespace shared with B's group by a PUT of its spec (before, the
    # name does not mean it: tests/api/test_sharers_and_warm_jobs.py)
    out["team_join"] = c.put_namespace("team", PAGE, share_gid=B)["owner"]
    out["listed"] = sorted(ns["name"] for ns in c.list_namespaces())
    out["stats"] = sorted(c.stats()["namespaces"])
    # shared with B's group: reachable, readable, but only A deletes it
    out["team_page"] = c.get_page("team", "t") == page("team")
    out["team_delete"] = status(lambda: c.delete_namespace("team"))
    # B's own "kv": a name A took first is still B's to create, with B's pages only
    made = c.put_namespace("kv", PAGE)
    out["own_kv"] = (made["owner"], made["identity"])
    out["own_exists_of_a_key"] = c.exists("kv", ["k"])
    c.put_page("kv", "k", page("b"))
    out["own_page"] = c.get_page("kv", "k") == page("b")
    c.put_page("team", "k", page("team-k"))  # a member writes into the shared namespace
    out["batch_hit"] = c.batch_exists(
        ["k", "t"], "kv", [{"namespace": "team", "policy": "all_pages"}]
    )
    return out


@root_only
def test_a_namespace_belongs_to_its_maker(node):
    url = node.socket_url
    a_sees = as_user(_tenant_a, url, uid=A, groups=[B])  # A is in B's group: it may share
    assert a_sees["kv"]["owner"] == A and a_sees["team"]["owner"] == A
    b = as_user(_tenant_b_probes, url, uid=B)
    assert {k: v for k, v in b.items() if type(v) is int and k != "own_exists_of_a_key"} == {
        "get_ns": 404,
        "exists": 404,
        "exists_each": 404,
        "get_page": 404,
        "put_page": 404,
        "delete_keys": 404,
        "prefetch": 404,
        "buffers": 404,
        "batch_exists": 404,
        "delete_ns": 404,
        "team_delete": 403,
        "team_join": A,
    }
    assert b["listed"] == ["team"] and b["stats"] == ["team"]  # A's kv is invisible to B
    assert b["team_page"] is True
    assert b["own_kv"][0] == B and b["own_kv"][1] != a_sees["kv"]["identity"]
    assert b["own_exists_of_a_key"] == 0 and b["own_page"] is True
    assert b["batch_hit"] == {"hit": 1, "kv": 1, "pools": {"team": 1}}  # B's kv holds "k" only
    # A's page is untouched, and A never sees B's namespace
    again = as_user(
        lambda u: SidecarClient(u, token=TOKEN).get_page("kv", "k") == page("a"), url, uid=A
    )
    assert again is True
    # the operator sees both, by name where one owner has it, by ref where two do
    op = node.tcp_client()
    names = sorted(ns["name"] for ns in op.list_namespaces())
    assert names == [f"kv@{B}", f"kv@{A}", "team"] or names == sorted(
        [f"kv@{A}", f"kv@{B}", "team"]
    )
    with pytest.raises(SidecarError) as e:
        op.get_page("kv", "k")
    assert e.value.status == 409
    assert op.get_page(f"kv@{A}", "k") == page("a") and op.get_page(f"kv@{B}", "k") == page("b")
    node.invariants()


def test_anonymous_tcp_reaches_only_namespaces_made_on_tcp(make_server):
    """Without a token, TCP is anyone on the node: not the operator."""
    srv = make_server()
    c, tcp = srv.client(), srv.tcp_client()
    c.put_namespace("engine", PAGE)
    c.put_page("engine", "k", page("e"))
    assert status(lambda: read(tcp, "engine", "k")) == 404
    assert status(lambda: tcp.delete_namespace("engine")) == 404
    assert [ns["name"] for ns in tcp.list_namespaces()] == []
    tcp.put_namespace("tool", PAGE)  # a namespace made on TCP: anonymous TCP's
    tcp.put_page("tool", "k", page("t"))
    assert tcp.get_page("tool", "k") == page("t")
    assert [ns["name"] for ns in tcp.list_namespaces()] == ["tool"]
    assert status(lambda: read(c, "tool", "k")) == 404  # not shared with the socket
    assert sorted(tcp.stats()["namespaces"]) == ["tool"]  # its own (issue 43, item 5)
    assert sorted(c.stats()["namespaces"]) == ["engine"]  # a peer: its own


def test_tier_identity_keeps_owners_apart(make_server, tmp_path):
    """Equal names and specs of different owners never share tier pages; a share group's
    members all reach the same one."""
    srv = make_server(file_tier=True, data_dir=str(tmp_path / "data"))
    wait_for(lambda: srv.ctx.ready)
    c, tcp = srv.client(), srv.tcp_client()
    mine = c.put_namespace("kv", PAGE)["identity"]
    ops = tcp.put_namespace("kv", PAGE)["identity"]
    shared = c.put_namespace("team", PAGE, share_gid=os.getgid())["identity"]  # a member
    assert len({mine, ops, shared}) == 3
    c.put_page("kv", "k", page("mine"))
    assert c.request("POST", "/v1/flush")[1]["pending"] == 0
    assert tcp.exists("kv", ["k"]) == 0
