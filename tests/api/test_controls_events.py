"""The KV events of the operators' controls (sidecar/controls/): a pin moves no page and
says nothing; an eviction is BlockRemoved from every medium that held the page; a warm is
BlockStored on CPU_PINNED. A subscriber's model matches what the sidecar holds after each."""

import pytest

from sidecar.events import block_hash
from tests.api.test_kv_events import PAGE, _probe_seen, evented, model_of, settled, truth  # noqa: F401
from tests.conftest import wait_for

msgspec = pytest.importorskip("msgspec")


def record(srv) -> list:
    seen: list = []
    real = srv.ctx.events.publisher.send
    srv.ctx.events.publisher.send = lambda topic, payload: (
        seen.append(bytes(payload)),
        real(topic, payload),
    )[1]
    return seen


def events_of(seen: list) -> list[tuple[str, str, set]]:
    out = []
    for payload in seen:
        for e in msgspec.msgpack.decode(payload)[1]:
            if e["type"] != "AllBlocksCleared":
                out.append((e["type"], e["medium"], set(e["block_hashes"])))
    return out


def by_kind(events: list) -> dict:
    out: dict = {}
    for kind, medium, hashes in events:
        out.setdefault((kind, medium), set()).update(hashes)
    return out


def test_pin_evict_and_warm_are_what_a_subscriber_expects(evented):  # noqa: F811
    srv, sub, _ = evented
    c = srv.client(timeout=30)
    wait_for(lambda: _probe_seen(srv, sub))
    c.put_namespace("kv", PAGE, key_format="vllm", page_tokens=4, host_capacity_bytes=8 * PAGE)
    keys = [f"{i:064x}" for i in range(16)]
    h = {k: block_hash(k, "vllm") for k in keys}
    for k in keys:  # 16 through 8 slots: 0-7 on disk only
        c.put_page("kv", k, bytes([len(k)]) * PAGE)
    assert c.request("POST", "/v1/flush")[1]["pending"] == 0
    settled(srv, sub)
    seen = record(srv)
    c.request("POST", "/v1/namespaces/kv/pin", {"keys": keys[12:16]})
    settled(srv, sub)
    assert events_of(seen) == []  # nothing moved
    c.request("POST", "/v1/namespaces/kv/evict", {"chain": keys, "from": keys[14]})
    settled(srv, sub)
    gone = {h[k] for k in keys[14:]}
    assert by_kind(events_of(seen)) == {
        ("BlockRemoved", "CPU_PINNED"): gone,
        ("BlockRemoved", "DISK"): gone,
    }
    assert model_of(sub, ["kv"]) == truth(srv, ["kv"])
    seen.clear()
    job = c.request("POST", "/v1/namespaces/kv/warm", {"keys": keys[:4]})[
        1
    ]  # 2 free slots, 2 evictions
    wait_for(lambda: c.request("GET", f"/v1/warm/{job['job']}")[1]["state"] == "done")
    settled(srv, sub)
    got = events_of(seen)
    stored = set().union(*(s for t, m, s in got if t == "BlockStored" and m == "CPU_PINNED"))
    removed = set().union(*(s for t, m, s in got if t == "BlockRemoved" and m == "CPU_PINNED"))
    assert stored == {h[k] for k in keys[:4]}
    assert len(removed) == 2 and not removed & {h[k] for k in keys[12:14]}  # never a pinned page
    assert all(m == "CPU_PINNED" for _, m, _ in got)  # the disk copies stay where they were
    assert model_of(sub, ["kv"]) == truth(srv, ["kv"])
    srv.invariants()
