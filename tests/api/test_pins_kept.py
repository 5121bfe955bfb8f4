"""Operators' pins outlive a restart (sidecar/controls/keeper.py): kept in the data dir,
restored into the namespace made again with the same spec by the same owner, never
another's; an unpin, a TTL's end and a delete stick; a damaged record is ignored and
counted."""

import hashlib
import os
import threading

import pytest

from api.engine.client import SidecarClient
from loadtest.kit.as_uid import as_user
from sidecar import ledger
from sidecar.tiers.file_tier import FileTier
from tests.conftest import Gate, wait_for

PAGE = 16384
TOKEN = "op-t0ken"
OTHER = 65532
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a tenant of another uid needs root")


def data(key: str) -> bytes:
    return hashlib.shake_256(key.encode()).digest(PAGE)


def post(c, path, body):
    return c.request("POST", path, body)[1]


def tiered(make_server, tmp_path, **kw):
    srv = make_server(file_tier=True, data_dir=str(tmp_path / "data"), **kw)
    wait_for(lambda: srv.ctx.ready)
    return srv


def stored(c, keys, ns="kv"):
    for k in keys:
        c.put_page(ns, k, data(k))
    assert c.request("POST", "/v1/flush")[1]["pending"] == 0


def restored(c, ns="kv") -> dict:
    """The namespace's pins once its restore has ended."""
    wait_for(lambda: not c.request("GET", f"/v1/namespaces/{ns}/pins")[1]["restoring"])
    return c.request("GET", f"/v1/namespaces/{ns}/pins")[1]


def records(tmp_path) -> list[str]:
    d = tmp_path / "data" / "pins"
    return sorted(n for n in os.listdir(d) if n.endswith(".pins")) if d.exists() else []


def test_pins_outlive_a_restart_with_what_is_left_of_their_ttl(make_server, tmp_path):
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    stored(c, [f"k{i}" for i in range(10)])
    got = post(c, "/v1/namespaces/kv/pin", {"keys": ["k0", "k1", "k2"], "ttl": 600})
    assert got["persisted"] is True and got["pinned"] == 3
    assert post(c, "/v1/namespaces/kv/pin", {"keys": ["k3"], "ttl": 60})["persisted"] is True
    srv.stop()
    again = tiered(make_server, tmp_path)
    c2 = again.client(timeout=30)
    c2.put_namespace("kv", PAGE)
    pins = restored(c2)
    left = {p["key"]: p["expires_in"] for p in pins["pins"]}
    assert sorted(left) == ["k0", "k1", "k2", "k3"]
    assert all(500 < left[k] <= 600 for k in ("k0", "k1", "k2")) and 0 < left["k3"] <= 60
    assert c2.stats()["namespaces"]["kv"]["pages"]["host"] == 4  # promoted, the rest not
    pool = again.ns("kv").pool
    assert again.on_loop(lambda: [pool.entries[k].pins for k in ("k0", "k3")]) == [1, 1]
    assert c2.request("GET", "/v1/pins")[1]["kept"]["restored"] == 4
    again.invariants()


def test_an_unpin_a_ttls_end_and_a_delete_stick_across_a_restart(make_server, tmp_path):
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    c.put_namespace("gone", PAGE)
    stored(c, ["a", "b", "c"])
    stored(c, ["g"], "gone")
    post(c, "/v1/namespaces/kv/pin", {"keys": ["a", "c"], "ttl": 600})
    post(c, "/v1/namespaces/kv/pin", {"keys": ["b"], "ttl": 5})
    post(c, "/v1/namespaces/gone/pin", {"keys": ["g"], "ttl": 600})
    assert len(records(tmp_path)) == 2
    assert post(c, "/v1/namespaces/kv/unpin", {"keys": ["a"]})["persisted"] is True
    ctl, loop = srv.ctx.store.controls, srv.ctx.loop
    assert srv.on_loop(lambda: ctl.expire(loop.time() + 6)) == 1  # b's TTL ends
    wait_for(lambda: srv.on_loop(lambda: not ctl.keeper.saved.records))  # written
    c.delete_namespace("gone")
    assert len(records(tmp_path)) == 1
    srv.stop()
    again = tiered(make_server, tmp_path)
    c2 = again.client(timeout=30)
    c2.put_namespace("kv", PAGE)
    c2.put_namespace("gone", PAGE)
    assert [p["key"] for p in restored(c2)["pins"]] == ["c"]
    assert restored(c2, "gone")["pages"] == 0
    assert c2.stats()["namespaces"]["kv"]["pages"]["host"] == 1


def test_another_owner_making_the_same_name_after_a_restart_gets_no_pins(make_server, tmp_path):
    """The operator pins in "kv"; the sidecar comes back without its token, so TCP is
    anyone on the node: its "kv" of the same spec gets neither the pins nor the pages. The
    operator's record stays: with the token again, its pins come back."""
    srv = tiered(make_server, tmp_path, token=TOKEN)
    op = srv.tcp_client(timeout=30)
    op.put_namespace("kv", PAGE)
    stored(op, ["a", "b"])
    assert post(op, "/v1/namespaces/kv/pin", {"keys": ["a", "b"], "ttl": 600})["persisted"]
    srv.stop()
    anyone = tiered(make_server, tmp_path)
    c = anyone.tcp_client(timeout=30)
    c.put_namespace("kv", PAGE)
    assert restored(c)["pages"] == 0
    assert c.stats()["namespaces"]["kv"]["pages"] == {"host": 0, "file": 0}
    post(c, "/v1/namespaces/kv/pin", {"keys": ["a"]})  # nothing of its own to pin
    assert c.request("GET", "/v1/pins")[1]["kept"]["records_damaged"] == 0
    anyone.stop()
    back = tiered(make_server, tmp_path, token=TOKEN)
    op2 = back.tcp_client(timeout=30)
    op2.put_namespace("kv", PAGE)
    assert sorted(p["key"] for p in restored(op2)["pins"]) == ["a", "b"]


def _other_uid(url: str) -> dict:
    """Another uid makes "kv" of the same spec after the restart: what it gets."""
    c = SidecarClient(url, timeout=30)
    c.put_namespace("kv", PAGE)
    pins = restored(c)
    return {"pins": pins["pages"], "host": c.stats()["namespaces"]["kv"]["pages"]["host"]}


@root_only
def test_another_uid_making_the_same_name_after_a_restart_gets_no_pins(make_server, tmp_path):
    srv = tiered(make_server, tmp_path, socket_mode=0o666)
    c = srv.client(timeout=30)  # uid 0: its "kv" is kv@0
    c.put_namespace("kv", PAGE)
    stored(c, ["a", "b"])
    assert post(c, "/v1/namespaces/kv/pin", {"keys": ["a", "b"], "ttl": 600})["persisted"]
    srv.stop()
    again = tiered(make_server, tmp_path, socket_mode=0o666)
    os.chmod(os.path.dirname(again.config.socket), 0o755)
    assert as_user(_other_uid, again.socket_url, uid=OTHER) == {"pins": 0, "host": 0}
    c2 = again.client(timeout=30)
    c2.put_namespace("kv", PAGE)
    assert sorted(p["key"] for p in restored(c2)["pins"]) == ["a", "b"]


def test_a_damaged_record_is_ignored_counted_and_removed(make_server, tmp_path):
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    stored(c, ["a"])
    post(c, "/v1/namespaces/kv/pin", {"keys": ["a"], "ttl": 600})
    srv.stop()
    (name,) = records(tmp_path)
    path = tmp_path / "data" / "pins" / name
    raw = path.read_bytes()
    at = raw.index(b'[["a",') + 6
    assert raw[at : at + 1] == b"1"  # the expiry: seconds since 1970, 10 digits
    path.write_bytes(raw[:at] + b"2" + raw[at + 1 :])  # still a record, 31 years later
    (tmp_path / "data" / "pins" / "junk.pins").write_bytes(b"\x00" * 100)
    again = tiered(make_server, tmp_path)  # starts
    c2 = again.client(timeout=30)
    c2.put_namespace("kv", PAGE)
    assert restored(c2)["pages"] == 0
    kept = c2.request("GET", "/v1/pins")[1]["kept"]
    assert kept["records_damaged"] == 1 and kept["restored"] == 0
    assert records(tmp_path) == ["junk.pins"]  # another name's: never read, aged out
    assert c2.exists_each("kv", ["a"]) == [True]  # the page itself is fine


def test_a_restore_past_a_shrunk_bound_drops_the_newest(make_server, tmp_path, monkeypatch):
    """70 pinned pages, 64 a segment: with a bound of one segment at the restore, the
    oldest 64 come back pinned, the newest 6 are dropped and counted."""
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    keys = [f"k{i:03}" for i in range(70)]
    stored(c, keys)
    for k in keys:  # one at a time: the pins' order is the keys'
        post(c, "/v1/namespaces/kv/pin", {"keys": [k], "ttl": 600})
    srv.stop()
    monkeypatch.setattr(ledger, "PIN_SHARE", 1 / 64)  # one segment of 64
    again = tiered(make_server, tmp_path)
    c2 = again.client(timeout=30)
    c2.put_namespace("kv", PAGE)
    assert [p["key"] for p in restored(c2)["pins"]] == keys[:64]
    kept = c2.request("GET", "/v1/pins")[1]["kept"]
    assert (kept["restored"], kept["restore_over_bound"]) == (64, 6)
    again.invariants()


def test_an_acknowledged_pin_outlives_a_kill(spawn, tmp_path):
    """Real processes: the pin's answer came once its record was durable, so a SIGKILL
    right after it loses nothing."""
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    args = ("--host-pool", "32MiB", "--data-dir", str(tmp_path / "data"), "--token-file", str(tok))
    p = spawn(*args).wait_ready(TOKEN)
    op = SidecarClient(p.url, token=TOKEN, timeout=30)
    op.put_namespace("kv", PAGE)
    stored(op, ["a", "b", "c"])
    assert post(op, "/v1/namespaces/kv/pin", {"keys": ["a", "b"], "ttl": 600})["persisted"]
    p.proc.kill()
    p.proc.wait()
    q = spawn(*args).wait_ready(TOKEN)
    op = SidecarClient(q.url, token=TOKEN, timeout=30)
    op.put_namespace("kv", PAGE)
    assert sorted(p["key"] for p in restored(op)["pins"]) == ["a", "b"]
    assert op.stats()["namespaces"]["kv"]["pages"]["host"] == 2


def test_a_get_during_a_restore_waits_for_the_page_not_a_miss(make_server, tmp_path, monkeypatch):
    """An engine's get of a page its restore is promoting waits for that promotion (the
    slot is reserved, not ready): what `exists` answered present is loaded, never missed."""
    srv = tiered(make_server, tmp_path)
    c = srv.client(timeout=30)
    c.put_namespace("kv", PAGE)
    stored(c, ["a"])
    post(c, "/v1/namespaces/kv/pin", {"keys": ["a"], "ttl": 600})
    srv.stop()
    again = tiered(make_server, tmp_path)
    gate = Gate(FileTier, "read", patch=monkeypatch.setattr)  # holds the restore's read
    c2 = again.client(timeout=30)
    c2.put_namespace("kv", PAGE)
    assert gate.entered.wait(30)
    got = []
    t = threading.Thread(target=lambda: got.append(c2.get_page("kv", "a")))
    t.start()
    tiering, ref = again.ctx.store.tiering, again.ns("kv").ref
    waiting = lambda: again.on_loop(lambda: bool(tiering.loading[(ref, "a")]._callbacks))  # noqa: E731
    try:
        wait_for(lambda: not t.is_alive() or waiting())
        assert t.is_alive()  # the get waits for the restore's read
    finally:
        gate.open()
        t.join(30)
    assert got == [data("a")]
    assert [p["key"] for p in restored(c2)["pins"]] == ["a"]
