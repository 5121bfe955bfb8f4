"""The index `recover` rebuilds (file_tier.py): pages found on disk are kept as a list
oldest mtime first, ahead of the LRU of pages added or read since; eviction takes the
least recent of both, exactly as one LRU would."""

import os
import tempfile
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.tiers import pagefile
from sidecar.tiers.file_tier import FileTier

IDS = ("0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210")
PAGE = 512
SIZE = pagefile.HEADER_SIZE + PAGE


def page(key: str) -> bytes:
    return key.encode().ljust(PAGE, b".")


def publish(root: str, ident: str, key: str, age: int) -> None:
    """A page file as the tier writes it, `age` seconds old."""
    d = os.path.join(root, ident)
    os.makedirs(d, 0o700, exist_ok=True)
    path = os.path.join(d, pagefile.page_name(key))
    with open(path, "wb") as f:
        f.write(pagefile.encode_header(key, page(key)) + page(key))
    t = 10**18 - age * 10**9
    os.utime(path, ns=(t, t))


def read(tier: FileTier, ident: str, key: str) -> bool:
    buf = bytearray(PAGE)
    return tier.read(ident, key, memoryview(buf)) and bytes(buf) == page(key)


def test_a_recovered_page_read_becomes_the_most_recent(tmp_path):
    for age, key in enumerate("abcd"):  # a newest, d oldest
        publish(str(tmp_path), IDS[0], key, age)
    t = FileTier("file", str(tmp_path), capacity=4 * SIZE)
    assert t.recover() == 4 and t.used == 4 * SIZE
    assert read(t, IDS[0], "d")  # the oldest, read: now the most recent
    assert t.write_batch([(IDS[0], k, memoryview(page(k))) for k in "ef"]) == [True, True]
    assert {k: t.contains(IDS[0], k) for k in "abcdef"} == {
        "a": True,
        "b": False,
        "c": False,
        "d": True,
        "e": True,
        "f": True,
    }
    assert t.pages() == 4 and t.used == 4 * SIZE


OPS = st.lists(
    st.tuples(
        st.sampled_from(["read", "write", "delete", "evict"]),
        st.sampled_from(IDS),
        st.sampled_from("abcdefgh"),
    ),
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(ages=st.lists(st.integers(0, 10**6), min_size=1, max_size=12, unique=True), ops=OPS)
def test_eviction_order_is_one_lru(ages, ops):
    """Against a model LRU (recovered pages by mtime, then every read or write moves a page
    to the end): each eviction takes the model's least recent page."""
    with tempfile.TemporaryDirectory() as root:
        found = {}
        for i, age in enumerate(ages):
            ident, key = IDS[i % 2], "abcdefgh"[i % 8] + str(i // 16)
            publish(root, ident, key, age)
            found[(ident, key)] = age
        model = OrderedDict((p, SIZE) for p in sorted(found, key=found.get, reverse=True))
        t = FileTier("file", root)
        assert t.recover() == len(model)
        for op, ident, key in ops:
            key += "0"
            if op == "read":
                assert read(t, ident, key) == ((ident, key) in model)
                if (ident, key) in model:
                    model.move_to_end((ident, key))
            elif op == "write":
                assert t.write_batch([(ident, key, memoryview(page(key)))]) == [True]
                model[(ident, key)] = SIZE
                model.move_to_end((ident, key))
            elif op == "delete":
                assert t.delete(ident, [key]) == ((ident, key) in model)
                model.pop((ident, key), None)
            else:
                assert t._evict_bytes(1) == (SIZE if model else 0)
                if model:
                    gone, _ = model.popitem(last=False)
                    assert not t.contains(*gone) and not os.path.exists(t._path(*gone))
            assert t.pages() == len(model) and t.used == SIZE * len(model)
        assert {(i, k) for i in t.keys for k in t.keys[i]} == set(model)


def test_the_scan_keeps_pages_only(tmp_path):
    """Page files are indexed, oldest first; an exited writer's temporary is removed; a link
    and a directory with a page's name are not pages."""
    for i in range(50):
        publish(str(tmp_path), IDS[0], f"k{i}", i)
    d = os.path.join(str(tmp_path), IDS[0])
    temp = os.path.join(d, f"~{pagefile.NODE}~{pagefile.BOOT}~999999999~0123abcd.tmp")
    open(temp, "wb").close()
    os.symlink(os.path.join(d, "k0.pg"), os.path.join(d, "link.pg"))
    os.mkdir(os.path.join(d, "sub.pg"))
    t = FileTier("file", str(tmp_path))
    assert t.recover() == 50 and not os.path.exists(temp)
    assert set(t.keys[IDS[0]]) == {f"k{i}" for i in range(50)} and t.used == 50 * SIZE
    assert t._cold[1][:3] == ["k49", "k48", "k47"] and set(t._cold[0]) == {IDS[0]}


def test_a_large_disk_reads_no_file_for_the_default_size(monkeypatch, tmp_path):
    """The default size is min(64 GiB, 90% of free + held): with 4 TB free it is 64 GiB
    whatever the tier holds, so start-up stats none of its files (1,000,000: seconds)."""
    from dataclasses import replace

    from sidecar import datadir
    from sidecar.config import Config

    for i in range(3):
        publish(str(tmp_path), IDS[0], f"k{i}", i)
    stats = []
    real_lstat = os.lstat
    monkeypatch.setattr(datadir.os, "lstat", lambda p: stats.append(p) or real_lstat(p))

    class Disk:
        f_bavail, f_frsize = 10**9, 4096

    monkeypatch.setattr(datadir.os, "statvfs", lambda path: Disk)
    config = replace(Config(), data_dir=str(tmp_path))
    assert datadir.file_tier_size(config)[0] == 64 * 2**30 and stats == []
    Disk.f_bavail = 1000  # a small disk: what the tier holds counts, all of it
    size, why = datadir.file_tier_size(config)
    pages = [p for p in stats if p.endswith(".pg")]
    held = sum(real_lstat(p).st_blocks * 512 for p in pages)
    assert (
        len(pages) == 3 and size == int(0.9 * (1000 * 4096 + held)) and f"{held} bytes held" in why
    )


def test_bench_recovery_runs_small(capsys, tmp_path):
    """`make bench-recovery` at 2,000 pages: every figure is there, and the temp dir goes."""
    import orjson

    from loadtest.micro import recovery as bench_recovery

    assert (
        bench_recovery.main(["--pages", "2000", "--rounds", "1", "--dir", str(tmp_path), "--json"])
        == 0
    )
    res = orjson.loads(capsys.readouterr().out.splitlines()[-1])
    assert res["pages"] == 2000 and 0 < res["recover_s"] < res["ready_s"]
    assert 50 < res["index_bytes_per_page"] < res["peak_bytes_per_page"]
    assert res["ready_default_size_s"] > 0 and os.listdir(tmp_path) == []
