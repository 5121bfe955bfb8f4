"""No 500 for hostile memory (issue 11, item 9), end to end on the engine socket: a memfd
sealed against writes can be registered and read from, and a get into it answers false."""

from __future__ import annotations

import fcntl
import os

from api.engine.shm import page_first_chunks

PAGE = 4096


def test_a_write_sealed_memfd_answers_false_never_500(server, client):
    client.put_namespace("kv", PAGE)
    fd = os.memfd_create("sealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 2 * PAGE)
    os.pwrite(fd, b"s" * PAGE, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    bid = client.register_buffer("kv", 2 * PAGE, 2, page_first_chunks(PAGE), fd=fd)
    assert client.set("kv", ["a"], bid, [0]) == [True]  # reading from it works
    assert client.get("kv", ["a"], bid, [1]) == [False]  # writing into it cannot
    assert os.pread(fd, PAGE, PAGE) == bytes(PAGE)
    assert client.get_page("kv", "a") == b"s" * PAGE
    assert client.health()["status"] == "ok"
    os.close(fd)
    server.invariants()
