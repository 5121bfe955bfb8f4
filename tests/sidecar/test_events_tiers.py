"""Tier changes become KV events a part a flush (sidecar/events.py `_drain_tiers`): in
order, TIER_KEYS_A_FLUSH pages at most, and what no namespace would hear of costs the
other tenants nothing (a dropped namespace's pages, an announcement a newer one replaced)."""

from __future__ import annotations

import asyncio
import types

import pytest

from loadtest.kit.procs import free_port
from pools.page_pool import PagePool

zmq = pytest.importorskip("zmq")
from sidecar import events as events_mod  # noqa: E402  (the `events` extra)
from sidecar.publisher import Publisher  # noqa: E402


def namespace(name: str, identity: str):
    spec = types.SimpleNamespace(key_format=None, page_tokens=16)
    return types.SimpleNamespace(
        name=name, identity=identity, spec=spec, pool=PagePool(name, 512, 2048)
    )


class HeldTier:
    name = "file"

    def __init__(self, held):
        self.held = held

    def held_keys(self, identity):
        return list(self.held.get(identity, ()))


def drained(events) -> dict:
    """The tier events one flush makes, by topic: the block hashes they name."""
    events._drain_tiers()
    out = {}
    for topic, evs in events.pending.items():
        out[topic.decode()] = [h for e in evs for h in e["block_hashes"]]
    events.pending.clear()
    return out


@pytest.fixture
def events(monkeypatch):
    monkeypatch.setattr(events_mod, "TIER_KEYS_A_FLUSH", 4)
    loop = asyncio.new_event_loop()
    pub = Publisher(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", 16, 1 << 20)
    ev = events_mod.Events(pub, "t", "map", loop, 0.02)
    yield ev
    pub.close()
    loop.close()


def test_a_part_a_flush_in_order_without_copying_the_rest(events):
    events.watch(namespace("a", "ida"), [HeldTier({"ida": [f"k{i}" for i in range(10)]})])
    events.tier_changed("ida", ["k3"], "DISK", False)
    parts = [drained(events) for _ in range(4)]
    assert [p.get("t@a") for p in parts[:3]] == [
        ["k0", "k1", "k2", "k3"],
        ["k4", "k5", "k6", "k7"],
        ["k8", "k9", "k3"],
    ]  # the removal after them
    assert not events.tier_log and parts[3] == {}


def test_what_no_namespace_hears_of_does_not_hold_back_the_others(events):
    """A dropped namespace's tier pages (200 here, 4 a flush) and an announcement a newer
    one replaced are skipped at no cost: the neighbour's page comes in the first flush."""
    old = namespace("gone", "idg")
    events.watch(old, [HeldTier({"idg": [f"g{i}" for i in range(200)]})])
    events.dropped_namespace(old)
    events.pending.clear()
    again = namespace("b", "idb")
    tier = HeldTier({"idb": ["b0"]})
    events.watch(again, [tier])
    events.dropped_namespace(again)
    events.watch(again, [tier])  # made again: its first announcement is replaced
    events.pending.clear()
    events.tier_changed("idn", ["n0"], "DISK", True)
    events.watch(namespace("n", "idn"), [HeldTier({})])
    first = drained(events)
    assert first == {"t@b": ["b0"], "t@n": ["n0"]}
    assert not events.tier_log
