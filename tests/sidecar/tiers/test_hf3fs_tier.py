"""The slotted 3FS tier (sidecar/tiers/hf3fs_tier.py): nodes sharing one directory find each
other's pages by tailing logs (a few file-system calls in all, never a rescan), and every
fault (a damaged or truncated log, slot file or snapshot, two writers of one key, a full
mount, a restart) is a miss or a refused write, never wrong bytes, never an acknowledged
page lost. Pollers are off (`poll=3600`): each test polls by hand, so no race needs a sleep."""

import errno
import hashlib
import os

import pytest

from sidecar.tiers import hf3fs_log as hlog
from sidecar.tiers import hf3fs_slots as slots
from sidecar.tiers.hf3fs_index import CompactIndex, pack, unpack
from sidecar.tiers.hf3fs_tier import Hf3fsTier

ID = "0123456789abcdef0123456789abcdef"
SIZE = 4096


def page(key, size=SIZE):
    return hashlib.shake_256(key.encode()).digest(size)


def node(root, name, **kw):
    t = Hf3fsTier(str(root), node=name, poll=3600, **kw)
    t.recover()
    return t


def write(tier, *keys, size=SIZE):
    return tier.write_batch([(ID, k, memoryview(page(k, size))) for k in keys])


def read(tier, key, size=SIZE):
    buf = bytearray(size)
    return bytes(buf) if tier.read(ID, key, memoryview(buf)) else None


def node_dir(root, name):
    return os.path.join(str(root), "nodes", name)


class Calls:
    """Counts the file-system calls made through `os` while it is installed."""

    NAMES = ("open", "stat", "lstat", "fstat", "listdir", "scandir", "access", "pread")

    def __init__(self, monkeypatch):
        self.n = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._counted(name, real))

    def _counted(self, name, real):
        def call(*a, **kw):
            self.n[name] += 1
            return real(*a, **kw)

        return call

    @property
    def metadata(self):
        return sum(v for k, v in self.n.items() if k != "pread")


def test_the_compact_index_keeps_sixteen_bytes_an_entry_and_removes_by_location():
    ix = CompactIndex(bits=2)  # four buckets: many entries share one
    for h in range(1, 2001):
        assert ix.put(h * 7919, pack(1, 2, h, h % 64)) is None
    assert len(ix) == 2000 and ix.get(7919 * 5) == pack(1, 2, 5, 5)
    assert unpack(pack(3, 4095, 2**30 - 1, 63)) == (3, 4095, 2**30 - 1, 63)
    assert ix.remove(7919 * 5, pack(9, 9, 9, 9)) is None  # another copy: stays
    assert ix.remove(7919 * 5, pack(1, 2, 5, 5)) == pack(1, 2, 5, 5)
    assert ix.get(7919 * 5) is None and ix.get(7919 * 6) == pack(1, 2, 6, 6)
    gone = ix.remove_where(lambda w: unpack(w)[2] % 2 == 0)
    assert len(gone) == 1000 and len(ix) == 999  # (5, odd, was removed already)


def test_a_page_written_on_one_node_is_found_on_another_with_a_few_calls(tmp_path, monkeypatch):
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    keys = [f"k{i}" for i in range(1000)]
    assert all(write(a, *keys))
    assert not b.contains(ID, "k0")  # not before B reads A's log
    b.poll_once()  # A's log is new to B: found by the node listing (B's first poll)
    assert all(b.contains(ID, k) for k in keys) and b.count(ID) == 1000
    assert write(a, *[f"n{i}" for i in range(1000)]) == [True] * 1000
    calls = Calls(monkeypatch)
    b._next_scan = float("inf")  # (the once-a-second node listing is not due)
    assert b.poll_once() == 1000
    assert calls.metadata == 0 and calls.n["pread"] <= 2  # one read of A's log (+ its end)
    monkeypatch.undo()
    assert all(b.contains(ID, f"n{i}") for i in range(1000))
    assert read(b, "n7") == page("n7") and read(b, "k999") == page("k999")
    assert b.describe()["pages"] == 2000 and b.describe()["own_pages"] == 0


def test_no_rescan_after_start_only_the_logs_are_read(tmp_path, monkeypatch):
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    write(a, "x")
    b.poll_once()
    calls = Calls(monkeypatch)
    for _ in range(20):
        b.poll_once()  # nothing new: one pread a poll, plus the node listing once a second
    assert calls.n["pread"] == 20 and calls.n["scandir"] <= 1 and calls.n["stat"] == 0
    assert b.recover() == 0  # the sidecar's periodic "rescan" is one more poll
    assert calls.n["scandir"] <= 2 and calls.n["listdir"] == 0


def test_each_node_writes_only_its_own_files_and_a_restart_reloads_every_node(tmp_path):
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    write(a, *[f"a{i}" for i in range(100)])
    write(b, *[f"b{i}" for i in range(100)])
    a.poll_once()
    b.poll_once()
    b.close()
    b2 = node(tmp_path, "b")
    assert b2.node == "b" and b2.pages() == 200 and b2.describe()["own_pages"] == 100
    files_before = sorted(os.listdir(node_dir(tmp_path, "b")))
    # a restarted node does not draw writes: pages the tier holds (any node's) are not
    # written again, and the other node still writes its own files only
    assert write(b2, *[f"a{i}" for i in range(100)], *[f"b{i}" for i in range(100)]) == [True] * 200
    assert b2.stats.pages_written == 0
    assert sorted(os.listdir(node_dir(tmp_path, "b"))) == files_before
    write(a, "a-new")
    b2.poll_once()
    assert read(b2, "a-new") == page("a-new") and read(b2, "b5") == page("b5")
    assert sorted(os.listdir(node_dir(tmp_path, "b"))) == files_before  # A wrote its own


def test_a_node_directory_that_is_a_link_is_never_read(tmp_path):
    a = node(tmp_path, "a")
    write(a, "k")
    os.symlink(node_dir(tmp_path, "a"), node_dir(tmp_path, "planted"))
    b = node(tmp_path, "b")
    b.poll_once()
    assert [p.name for p in b.peers] == ["b", "a"] and b.count(ID) == 1


def test_a_second_live_sidecar_of_one_name_takes_another(tmp_path):
    a = node(tmp_path, "same")
    b = node(tmp_path, "same")
    assert a.node == "same" and b.node == "same.1"
    a.close()
    assert node(tmp_path, "same").node == "same"  # free again once its holder is gone


def test_deletes_and_evictions_reach_the_other_nodes_and_the_owner_frees(tmp_path):
    a = node(tmp_path, "a", capacity=4 * 64 * slots.stride(SIZE))  # four full files
    b = node(tmp_path, "b")
    write(a, *[f"k{i}" for i in range(64)])
    b.poll_once()
    assert b.delete(ID, ["k1", "k2"]) == 2  # A's copies: B logs DELs naming them
    a.poll_once()  # A frees them and logs its own DELs
    assert not a.contains(ID, "k1") and a.describe()["own_pages"] == 62
    b.poll_once()
    assert not b.contains(ID, "k2") and b.contains(ID, "k3")
    for i in range(0, 4 * 64, 64):  # past the capacity: A evicts its oldest files
        assert write(a, *[f"m{j}" for j in range(i, i + 64)]) == [True] * 64
    assert a.stats.evictions > 0 and a.held() <= a.capacity
    b.poll_once()
    assert not b.contains(ID, "k3") and read(b, "k3") is None
    assert b.contains(ID, "m255") and read(b, "m255") == page("m255")
    assert b.count(ID) == a.count(ID) == a.describe()["own_pages"]


def test_one_batch_past_the_cap_commits_its_first_files_then_evicts_them(tmp_path):
    """A writer batch bigger than --hf3fs-size is not refused for holding the cap itself:
    it publishes what it placed, evicts its own oldest files, and places the rest."""
    a = node(tmp_path, "a", capacity=16 * slots.stride(SIZE))  # four files of four slots
    keys = [f"k{i}" for i in range(40)]
    assert write(a, *keys) == [True] * 40
    assert a.stats.evictions > 0 and a.stats.write_errors == 0, a.stats
    assert a.held() <= a.capacity and read(a, "k39") == page("k39")
    assert not a.contains(ID, "k0") and a.count(ID) == a.describe()["own_pages"] < 40


def test_two_nodes_writing_one_key_both_publish_and_serve_only_right_bytes(tmp_path):
    a, b, c = node(tmp_path, "a"), node(tmp_path, "b"), node(tmp_path, "c")
    assert write(a, "same") == [True] and write(b, "same") == [True]  # neither saw the other
    c.poll_once()
    assert c.contains(ID, "same") and read(c, "same") == page("same")
    a.poll_once()
    b.poll_once()
    assert a.delete(ID, ["same"]) == 1  # A forgets the copy its index names (its own)
    c.poll_once()
    b.poll_once()
    assert read(c, "same") in (None, page("same"))  # B's copy may stay: never wrong bytes
    assert read(b, "same") in (None, page("same"))


def test_a_damaged_or_truncated_slot_file_is_a_miss(tmp_path):
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    write(a, "p0", "p1", "p2")
    b.poll_once()
    path = os.path.join(node_dir(tmp_path, "a"), slots.file_name(0))
    stride = slots.stride(SIZE)
    with open(path, "r+b") as f:
        f.seek(1 * stride + slots.head_room(SIZE) + 100)
        f.write(b"\xff\x00\xff")  # a flipped page byte (p1)
        f.seek(2 * stride + 10)
        f.write(b"XX")  # a damaged header (p2)
    assert read(b, "p1") is None and read(b, "p2") is None and read(b, "p0") == page("p0")
    assert b.stats.corrupt == 2 and not b.contains(ID, "p1")
    os.truncate(path, stride // 2)  # a truncated slot file: p0's bytes are cut
    b.fds.close()
    assert read(a, "p0") is None and a.stats.corrupt == 1


def test_a_damaged_or_truncated_log_loses_only_its_damaged_records(tmp_path):
    a = node(tmp_path, "a")
    write(a, *[f"k{i}" for i in range(10)])
    log = os.path.join(node_dir(tmp_path, "a"), hlog.log_name(0))
    size = os.path.getsize(log) // 10
    with open(log, "r+b") as f:
        f.seek(3 * size + 30)
        f.write(b"\x00\x01\x02")  # record 3 damaged in the middle
    b = node(tmp_path, "b")
    present = [b.contains(ID, f"k{i}") for i in range(10)]
    assert present == [i != 3 for i in range(10)] and b.damaged >= 1
    assert all(read(b, f"k{i}") == page(f"k{i}") for i in range(10) if i != 3)
    os.truncate(log, 7 * size + size // 2)  # a torn tail: record 7 half there
    c = node(tmp_path, "c")
    assert [c.contains(ID, f"k{i}") for i in range(10)] == [
        i not in (3, 7, 8, 9) for i in range(10)
    ]


def test_a_crash_mid_append_leaves_a_torn_tail_the_owner_cuts_on_restart(tmp_path):
    a = node(tmp_path, "a")
    write(a, "k0")
    b = node(tmp_path, "b")
    rec = hlog.encode(hlog.Record(hlog.PUT, 5, a.peers[0].tag, bytes(16), 0, 1, SIZE, 0, "torn"))
    log = os.path.join(node_dir(tmp_path, "a"), hlog.log_name(0))
    with open(log, "ab") as f:
        f.write(rec[: len(rec) // 2])  # what a node killed mid-append leaves
    a.close()
    assert b.poll_once() == 0 and b.contains(ID, "k0")  # the half record waits, unapplied
    a2 = node(tmp_path, "a")  # the restart cuts the torn tail, then appends whole records
    assert os.path.getsize(log) % 10 and a2.contains(ID, "k0")
    write(a2, "k1")
    assert b.poll_once() == 1 and read(b, "k1") == page("k1") and b.damaged == 0


def test_forged_records_are_contained(tmp_path):
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    write(a, "real")
    raw = bytes.fromhex(ID)
    log = os.path.join(node_dir(tmp_path, "a"), hlog.log_name(0))
    forged = [  # valid checksums, but: another node's tag / a hash not of its key / a slot
        # that holds another page
        hlog.Record(hlog.PUT, 1, b.peers[0].tag, raw, 0, 0, SIZE, 0, "x1"),
        hlog.Record(hlog.PUT, 12345, a.peers[0].tag, raw, 0, 0, SIZE, 0, "x2"),
    ]
    from sidecar.tiers.hf3fs_index import page_hash

    forged.append(
        hlog.Record(hlog.PUT, page_hash(raw, "x3"), a.peers[0].tag, raw, 0, 0, SIZE, 0, "x3")
    )
    with open(log, "ab") as f:
        f.write(b"".join(map(hlog.encode, forged)))
    b.poll_once()
    assert not b.contains(ID, "x1") and not b.contains(ID, "x2") and b.damaged == 2
    assert b.contains(ID, "x3") and read(b, "x3") is None  # slot 0 holds "real": a miss
    assert read(b, "real") == page("real")


def test_a_full_mount_refuses_the_write_and_keeps_what_was_acknowledged(tmp_path, monkeypatch):
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    assert write(a, "kept") == [True]

    def full(*_a, **_kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)  # the slot write
    assert write(a, "s1") == [False] and not a.contains(ID, "s1")
    monkeypatch.undo()
    real = os.pwrite

    def half(fd, data, offset):  # the log append: half a record lands, then ENOSPC
        if len(data) > 20:
            real(fd, bytes(data[: len(data) // 2]), offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", half)
    assert write(a, "s2") == [False] and not a.contains(ID, "s2")
    monkeypatch.undo()
    assert a.stats.write_errors == 2 and a.degraded
    assert write(a, "s3") == [True]  # space again: the log was cut back, nothing torn
    b.poll_once()
    assert not b.contains(ID, "s1") and not b.contains(ID, "s2") and b.damaged == 0
    assert read(b, "s3") == page("s3")
    # ENOSPC made A evict its least recent file (a cache frees room; its DELs are logged):
    # "kept" is then gone everywhere, never served torn
    assert b.contains(ID, "kept") == a.contains(ID, "kept")
    assert read(b, "kept") in (None, page("kept"))


def test_compaction_and_a_restart_from_the_snapshot(tmp_path):
    a = node(tmp_path, "a")
    a.compact_at = 50
    b = node(tmp_path, "b")
    for i in range(4):
        write(a, *[f"r{i}-{j}" for j in range(40)])  # each batch past 50 records compacts
    a.delete(ID, ["r0-0"])
    b.poll_once()  # B follows NEXT records from log to log
    assert b.count(ID) == 159 and read(b, "r3-39") == page("r3-39")
    names = os.listdir(node_dir(tmp_path, "a"))
    assert len([n for n in names if n.startswith("log.")]) <= 2  # older generations removed
    c = node(tmp_path, "c")
    assert c.count(ID) == 159 and not c.contains(ID, "r0-0")
    a.close()
    a2 = node(tmp_path, "a")
    assert a2.describe()["own_pages"] == 159 and read(a2, "r1-5") == page("r1-5")
    gen = a2.log.gen
    with open(os.path.join(node_dir(tmp_path, "a"), hlog.snap_name(gen)), "r+b") as f:
        f.seek(60)
        f.write(b"\xff\xff")  # the newest snapshot damaged: the one before and its log
    d = node(tmp_path, "d")
    assert d.count(ID) == 159 and read(d, "r2-7") == page("r2-7")


@pytest.mark.parametrize("length", [100, SIZE, 64 * 1024])
def test_slot_layout_round_trips_any_length(tmp_path, length):
    a = node(tmp_path, "a")
    assert write(a, "x", size=length) == [True]
    assert read(a, "x", size=length) == page("x", length) and read(a, "x", size=length + 1) is None
