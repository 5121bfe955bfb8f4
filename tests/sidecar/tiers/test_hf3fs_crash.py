"""A 3FS node SIGKILLed mid-write (a real child process, held at the exact step by a pipe,
not a sleep): its acknowledged pages stay whole for every other node, the page it was
writing never becomes visible (torn slot, or half its index record), and the restarted
node cuts its log's torn tail and goes on."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from sidecar.tiers.hf3fs_tier import Hf3fsTier

ID = "0123456789abcdef0123456789abcdef"
SIZE = 8192
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

CHILD = textwrap.dedent(
    """
    import hashlib, os, sys, time
    from sidecar.tiers.hf3fs_tier import Hf3fsTier
    root, mode = sys.argv[1], sys.argv[2]
    ID = "0123456789abcdef0123456789abcdef"
    page = lambda k: hashlib.shake_256(k.encode()).digest(8192)
    t = Hf3fsTier(root, node="victim", poll=3600)
    t.recover()
    assert all(t.write_batch([(ID, f"acked{i}", page(f"acked{i}")) for i in range(10)]))
    print("acked", flush=True)

    def hold():
        print("holding", flush=True)
        time.sleep(120)

    if mode == "slot":  # the header and half the page bytes reach the slot
        real_writev = os.pwritev
        def torn_slot(fd, bufs, offset):
            real_writev(fd, [bytes(bufs[0]), bytes(bufs[1])[: len(bufs[1]) // 2]], offset)
            os.fsync(fd)
            hold()
        os.pwritev = torn_slot
    elif mode == "synced":  # the slot is whole and synced; its record not yet appended
        real_sync = os.fdatasync
        def synced(fd):
            real_sync(fd)
            hold()
        os.fdatasync = synced
    else:  # half the PUT record reaches the log
        real_write = os.pwrite
        def torn_record(fd, data, offset):
            real_write(fd, bytes(data)[: len(data) // 2], offset)
            os.fsync(fd)
            hold()
        os.pwrite = torn_record
    t.write_batch([(ID, "torn", page("torn"))])
    """
)


def page(key):
    return hashlib.shake_256(key.encode()).digest(SIZE)


def read(tier, key):
    buf = bytearray(SIZE)
    return bytes(buf) if tier.read(ID, key, memoryview(buf)) else None


def kill_mid_write(root, mode):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "acked"
        assert child.stdout.readline().strip() == "holding"  # held at the step: kill it
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("mode", ["slot", "synced", "record"])
def test_a_node_killed_mid_write_loses_nothing_acknowledged_and_shows_no_torn_page(tmp_path, mode):
    reader = Hf3fsTier(str(tmp_path), node="reader", poll=3600)
    reader.recover()
    kill_mid_write(tmp_path, mode)
    reader.poll_once()
    assert all(read(reader, f"acked{i}") == page(f"acked{i}") for i in range(10))
    assert not reader.contains(ID, "torn") and read(reader, "torn") is None
    late = Hf3fsTier(str(tmp_path), node="late", poll=3600)  # a node started after the crash
    late.recover()
    assert late.count(ID) == 10 and not late.contains(ID, "torn")
    victim = Hf3fsTier(str(tmp_path), node="victim", poll=3600)  # the restart
    victim.recover()
    assert victim.node == "victim" and victim.describe()["own_pages"] == 10
    assert not victim.contains(ID, "torn")
    assert victim.write_batch([(ID, "after", memoryview(page("after")))]) == [True]
    reader.poll_once()
    assert read(reader, "after") == page("after") and reader.damaged == 0
    assert read(reader, "acked3") == page("acked3")
