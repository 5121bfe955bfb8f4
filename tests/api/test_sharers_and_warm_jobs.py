"""Red-team review of the tenancy and controls changes (issues 43, 47): what a sharer of a
namespace, or a tenant with many warm jobs, could still learn or take. Real sockets, uids."""

import os

import pytest

from api.engine.client import SidecarClient
from loadtest.kit.as_uid import as_user
from sidecar import controls
from tests.api.test_controls import PAGE, TOKEN, post, put, tiered
from tests.conftest import wait_for

B = 65532
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a tenant of another uid needs root")


def _sharer_lists(url: str) -> dict:
    c = SidecarClient(url, token=TOKEN)
    c.put_namespace("team", PAGE, share_gid=B)  # joins it
    return c.request("GET", "/v1/namespaces/team/pins")[1]


@root_only
def test_a_sharer_listing_pins_learns_nothing_of_the_owners_other_namespaces(make_server, tmp_path):
    """A member of the share group lists the shared namespace's pins: it sees those pins, not
    how many pages its owner pinned in its private namespaces (`usage` spans all of them)."""
    srv = tiered(make_server, tmp_path, socket_mode=0o666, token=TOKEN)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    a = srv.client()
    a.put_namespace("secret", PAGE)
    as_user(
        lambda url: SidecarClient(url, token=TOKEN).put_namespace("team", PAGE, share_gid=B),
        srv.socket_url,
        uid=0,
        groups=[0, B],
    )
    put(a, "secret", ["s1", "s2", "s3"])
    put(a, "team", ["t"])
    post(a, "/v1/namespaces/secret/pin", {"keys": ["s1", "s2", "s3"]})
    post(a, "/v1/namespaces/team/pin", {"keys": ["t"]})
    got = as_user(_sharer_lists, srv.socket_url, uid=B)
    assert [p["key"] for p in got["pins"]] == ["t"] and got["pages"] == 1
    assert not {"pinned_pages", "held_bytes", "bound_bytes"} & set(got), got
    own = a.request("GET", "/v1/namespaces/team/pins")[1]
    assert own["pinned_pages"] == 4  # the owner still sees its whole usage
    assert srv.tcp_client().request("GET", "/v1/namespaces/team/pins")[1]["pinned_pages"] == 4


def _warm_until_done(c: SidecarClient, ns: str, key: str) -> str:
    job = post(c, f"/v1/namespaces/{ns}/warm", {"keys": [key]}, ok=(429,))
    while job[0] == 429:  # one of the owner's 4 running: the next turn ends it
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


S = 4242  # a group every tenant of the socket is in (the socket's group, "users")


def _squat(url: str) -> bool:
    c = SidecarClient(url, token=TOKEN)
    c.put_namespace("kv", PAGE, share_gid=S)  # a member: allowed
    return c.put_page("kv", "p", b"M" * PAGE)


def _victim_before_its_put(url: str) -> dict:
    """The victim's engine after a sidecar restart (or a delete), before it PUTs its own."""
    c = SidecarClient(url, token=TOKEN)
    got = {
        "exists": c.request("POST", "/v1/namespaces/kv/exists", {"keys": ["p"]}, ok=(404,))[0],
        "page": c.request("GET", "/v1/namespaces/kv/pages/p", raw=True, ok=(404,))[0],
        "set": c.request("PUT", "/v1/namespaces/kv/pages/q", b"V" * PAGE, ok=(404,))[0],
    }
    c.put_namespace("kv", PAGE)  # its own, private: from now on "kv" means it
    got["after"] = c.exists_each("kv", ["p"])
    return got


def _joiner(url: str) -> list:
    c = SidecarClient(url, token=TOKEN)
    c.put_namespace("kv", PAGE, share_gid=S)  # joins the shared one on purpose
    return c.exists_each("kv", ["p"])


@root_only
def test_a_name_means_a_shared_namespace_only_to_whom_joined_it(make_server, tmp_path):
    """A tenant in a group every tenant is in shares "kv" with it: a victim whose own "kv"
    is not there yet (a restart, a delete) must get 404 (its engine then PUTs its own), not
    the squatter's namespace to read planted pages from and store its prompts' pages in."""
    srv = tiered(make_server, tmp_path, socket_mode=0o666, token=TOKEN)
    os.chmod(os.path.dirname(srv.config.socket), 0o755)
    assert as_user(_squat, srv.socket_url, uid=NOBODY, groups=[S])
    got = as_user(_victim_before_its_put, srv.socket_url, uid=B, groups=[S])
    assert got == {"exists": 404, "page": 404, "set": 404, "after": [False]}, got
    assert as_user(_joiner, srv.socket_url, uid=B + 1, groups=[S]) == [True]
