"""The pin records' files (sidecar/controls/pin_store.py): written durable and private,
coalesced to one write in flight a record, read only for their own scope, swept of what is
stale."""

import asyncio
import os
import stat
import threading
import time

from sidecar.controls.pin_store import PinStore, encode
from sidecar.tiers import pagefile

IDENT, REF = "0" * 32, "kv@1000"


def test_a_record_is_private_and_read_back_only_for_its_own_scope(tmp_path):
    store = PinStore(str(tmp_path / "pins"))
    pins = [("a", time.time() + 600), ("b", time.time() + 60)]

    async def run():
        ok = await store.changed(IDENT, REF, 1000, lambda: pins)
        mine = await store.load(IDENT, REF, 1000)
        store.release(IDENT, REF, list, False)
        other = await store.load(IDENT, "kv@1001", 1001)  # another owner's name: no file
        store.release(IDENT, "kv@1001", list, False)
        await store.close(5)
        return ok, mine, other

    ok, mine, other = asyncio.run(run())
    assert ok and mine == pins and other == []
    (name,) = os.listdir(tmp_path / "pins")
    assert stat.S_IMODE(os.stat(tmp_path / "pins").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "pins" / name).st_mode) == 0o600
    assert store.damaged == 0


def test_changes_coalesce_into_one_write_in_flight(tmp_path):
    """100 changes while a write is held: one more write after it, never two at once."""
    store = PinStore(str(tmp_path / "pins"))
    real, held, go = store._write, threading.Event(), threading.Event()
    calls, running, most = [], [0], [0]

    def write(*args):
        running[0] += 1
        most[0] = max(most[0], running[0])
        calls.append(args[3])
        if len(calls) == 1:
            held.set()
            assert go.wait(10)
        try:
            return real(*args)
        finally:
            running[0] -= 1

    store._write = write
    state = [("a", time.time() + 600)]

    async def run():
        first = store.changed(IDENT, REF, 1000, lambda: list(state))
        await asyncio.get_running_loop().run_in_executor(None, held.wait)
        later = []
        for i in range(100):
            state.append((f"k{i}", time.time() + 600))
            later.append(store.changed(IDENT, REF, 1000, lambda: list(state)))
            await asyncio.sleep(0)  # each change in a loop turn of its own
        go.set()
        got = await asyncio.gather(first, *later)
        back = await store.load(IDENT, REF, 1000)
        store.release(IDENT, REF, list, False)
        await store.close(5)
        return got, back

    got, back = asyncio.run(run())
    assert all(got) and len(calls) == 2 and most[0] == 1
    assert [k for k, _ in back] == [k for k, _ in state]


def test_a_planted_link_a_foreign_record_and_stale_files(tmp_path):
    """A link where a record goes is never followed; a record of another scope under this
    one's name is damaged; records past 7 days and abandoned temporaries are swept."""
    root = tmp_path / "pins"
    root.mkdir(mode=0o700)
    store = PinStore(str(root))
    name = store._name(IDENT, REF)
    target = tmp_path / "target"
    target.write_bytes(encode(IDENT, REF, [("a", time.time() + 600)]))
    os.symlink(target, root / name)
    other = store._name(IDENT, "kv@1001")
    (root / other).write_bytes(encode(IDENT, REF, [("a", time.time() + 600)]))
    old = root / ("f" * 32 + ".pins")
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 8 * 86400,) * 2)
    temp = root / pagefile.temp_name()
    temp.write_bytes(b"x")
    os.utime(temp, (time.time() - 2 * pagefile.TEMP_MAX_AGE,) * 2)

    async def run():
        got = []
        for ref, owner in ((REF, 1000), ("kv@1001", 1001)):
            got.append(await store.load(IDENT, ref, owner))
            store.release(IDENT, ref, list, False)
        await store.close(5)
        return got

    assert asyncio.run(run()) == [[], []]
    assert store.damaged == 2 and target.exists()
    assert sorted(os.listdir(root)) == []
