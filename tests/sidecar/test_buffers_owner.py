"""A buffer registered with a pid is released when that process is gone, and a new process
that got the same pid (pid reuse) is not mistaken for its owner: the start time must match."""

import subprocess
import sys

from sidecar.buffers import Buffer, process_start


def buffer_of(pid, start):
    return Buffer("b-1", "kv", "shm", 4096, 1, (), None, pid=pid, pid_start=start)


def test_owner_alive_checks_pid_and_start_time():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start(child.pid)
        assert start is not None and start.isdigit()
        assert buffer_of(child.pid, start).owner_alive()
        # the same pid with another start time: a new process that reused the number
        reused = str(int(start) + 1)
        assert not buffer_of(child.pid, reused).owner_alive()
        assert buffer_of(None, None).owner_alive()  # no pid watched: never released
    finally:
        child.kill()
        child.wait()
    assert process_start(child.pid) is None
    assert not buffer_of(child.pid, start).owner_alive()
