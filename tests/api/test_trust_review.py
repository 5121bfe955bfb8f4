"""Red-team review of the tenancy and controls changes (issues 43, 47): what a sharer of a
namespace, or a tenant with many warm jobs, could still learn or take. Real sockets, uids."""

import os

import pytest

from api.engine.client import SidecarClient
from loadtest.redteam import as_user
from sidecar import controls
from tests.api.test_controls import PAGE, TOKEN, post, put, tiered
from tests.conftest import wait_for

B = 65532
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a tenant of another uid needs root")


def _sharer_lists(url: str) -> dict:
    return SidecarClient(url, token=TOKEN).request("GET", "/v1/namespaces/team/pins")[1]


@root_only
def test_a_sharer_listing_pins_learns_nothing_of_the_owners_other_namespaces(make_server, tmp_path):
    """A member of the share group lists the shared namespace's pins: it sees those pins, not
    how many pages its owner pinned in its private namespaces (`usage` spans all of them)."""
    srv = tiered(make_server, tmp_path, socket_mode=0o666, token=TOKEN)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    a = srv.client()
    a.put_namespace("secret", PAGE)
    as_user(lambda url: SidecarClient(url, token=TOKEN).put_namespace("team", PAGE, share_gid=B),
            srv.socket_url, uid=0, groups=[0, B])
    put(a, "secret", ["s1", "s2", "s3"])
    put(a, "team", ["t"])
    post(a, "/v1/namespaces/secret/pin", {"keys": ["s1", "s2", "s3"]})
    post(a, "/v1/namespaces/team/pin", {"keys": ["t"]})
    got = as_user(_sharer_lists, srv.socket_url, uid=B)
    assert [p["key"] for p in got["pins"]] == ["t"] and got["pages"] == 1
    assert not {"pinned_pages", "held_bytes", "bound_bytes"} & set(got), got
    own = a.request("GET", "/v1/namespaces/team/pins")[1]
    assert own["pinned_pages"] == 4   # the owner still sees its whole usage
    assert srv.tcp_client().request("GET", "/v1/namespaces/team/pins")[1]["pinned_pages"] == 4


def _warm_until_done(c: SidecarClient, ns: str, key: str) -> str:
    job = post(c, f"/v1/namespaces/{ns}/warm", {"keys": [key]}, ok=(429,))
    while job[0] == 429:   # one of the owner's 4 running: the next turn ends it
        job = post(c, f"/v1/namespaces/{ns}/warm", {"keys": [key]}, ok=(429,))
    return job[1]["job"]


def _many_jobs(url: str) -> int:
    c = SidecarClient(url, token=TOKEN)
    c.put_namespace("mine", PAGE)
    put(c, "mine", ["m"])
    for _ in range(controls.WARM_KEPT + 8):
        _warm_until_done(c, "mine", "m")
    return 0


@root_only
def test_a_tenants_warm_jobs_neither_push_out_anothers_nor_keep_their_keys(make_server, tmp_path):
    """Tenant B starts more warm jobs than the sidecar keeps: A's finished job is still
    readable; an ended job keeps its page count, not its list of keys."""
    srv = tiered(make_server, tmp_path, socket_mode=0o666, token=TOKEN)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    a = srv.client()
    a.put_namespace("kv", PAGE)
    keys = [f"k{i}" for i in range(64)]
    put(a, "kv", keys)
    job = post(a, "/v1/namespaces/kv/warm", {"keys": keys})[1]["job"]
    wait_for(lambda: a.request("GET", f"/v1/warm/{job}")[1]["state"] == "done")
    as_user(_many_jobs, srv.socket_url, uid=B)
    got = a.request("GET", f"/v1/warm/{job}", ok=(404,))
    assert got[0] == 200 and got[1]["pages"] == 64, got
    jobs = srv.on_loop(lambda: list(srv.ctx.store.controls.jobs.values()))
    assert sum(j.ns.owner == B for j in jobs) <= controls.WARM_KEPT_PER_OWNER
    assert all(j.keys == [] for j in jobs if j.state != "running")
