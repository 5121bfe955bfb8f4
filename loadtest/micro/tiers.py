"""`python -m loadtest.micro.tiers`: the file tier against the raw disk, in one run.

    write-through: shm set of N x 2 MiB pages + flush   vs  O_DIRECT sequential write + fsync
    promotion:     restart, shm get of the same pages   vs  O_DIRECT sequential read
    recovery:      index rebuild for 100,000 page files (in-process and process start to ready)

Same bytes, same thread count (--tier-threads), same directory's disk. Page cache is dropped
(posix_fadvise DONTNEED) before each read phase, so reads come from the disk.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import orjson

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.procs import start_sidecar
from sidecar.tiers import pagefile
from sidecar.tiers.file_tier import FileTier

PAGE = 2 << 20


def raw_write_read(directory: str, total: int, threads: int) -> tuple[float, float]:
    """GB/s of O_DIRECT sequential write (+fsync) and read, `threads` files in parallel."""
    share = total // threads
    buf = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(PAGE))
    paths = [os.path.join(directory, f"raw-{i}") for i in range(threads)]

    def write(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for off in range(0, share, PAGE):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        os.close(fd)

    def read(path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        mine = mmap.mmap(-1, PAGE)
        for off in range(0, share, PAGE):
            os.preadv(fd, [mine], off)
        os.close(fd)

    w = _timed_threads(write, paths)
    _drop_cache(directory)
    r = _timed_threads(read, paths)
    for p in paths:
        os.unlink(p)
    return total / w / 1e9, total / r / 1e9


def _timed_threads(fn, args) -> float:
    ts = [threading.Thread(target=fn, args=(a,)) for a in args]
    t = time.perf_counter()
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    return time.perf_counter() - t


def _drop_cache(directory: str) -> None:
    for root, _, files in os.walk(directory):
        for f in files:
            try:
                fd = os.open(os.path.join(root, f), os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            except OSError:
                pass


def _timed_pass(args: tuple, buf: SharedBuffer, op: str, pages: int) -> float:
    """Start a sidecar, move `pages` pages with `op` ("set": then flush) 64 at a time, stop it."""
    batch = 64
    proc = start_sidecar(*args)
    try:
        c = SidecarClient(proc.socket_url, timeout=600)
        c.put_namespace("bench", PAGE)
        bid = buf.register(c, "bench", batch, page_first_chunks(PAGE))
        move = c.set if op == "set" else c.get
        t = time.perf_counter()
        for i in range(0, pages, batch):
            keys = [f"p{j}" for j in range(i, min(i + batch, pages))]
            assert all(move("bench", keys, bid, list(range(len(keys)))))
        if op == "set":
            assert c.request("POST", "/v1/flush?timeout=600")[1]["pending"] == 0
        return time.perf_counter() - t
    finally:
        proc.stop()


def sidecar_write_read(directory: str, pages: int, threads: int) -> tuple[float, float]:
    """GB/s of write-through (set + flush) and of promotion (get after a restart)."""
    args = (
        "--host-pool",
        "1GiB",
        "--data-dir",
        directory,
        "--tier-threads",
        str(threads),
        "--segment-size",
        "64MiB",
    )
    buf = SharedBuffer(64 * PAGE)
    buf.bytes.fill_(3)
    write = _timed_pass(args, buf, "set", pages)
    _drop_cache(directory)
    read = _timed_pass(args, buf, "get", pages)
    buf.close()
    total = pages * PAGE
    return total / write / 1e9, total / read / 1e9


def recovery(directory: str, n: int) -> dict:
    """Write `n` small page files (no fsync: only the scan is timed), then rebuild the index."""
    ident = "ab" * 16
    page = b"\1" * 1024
    made = set()
    for i in range(n):
        key = f"{i:064x}"
        d = os.path.join(directory, ident)
        if d not in made:
            os.makedirs(d, exist_ok=True)
            made.add(d)
        with open(os.path.join(d, pagefile.page_name(key)), "wb") as f:
            f.write(pagefile.encode_header(key, page) + page)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        assert FileTier("file", directory).recover() == n
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    proc = start_sidecar("--host-pool", "64MiB", "--data-dir", directory)
    ready = time.perf_counter() - t
    proc.stop()
    return {"pages": n, "recover_s": statistics.median(times), "start_to_ready_s": ready}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dir", help="a directory on the disk to measure (default: a temp dir)")
    p.add_argument("--pages", type=int, default=256, help="2 MiB pages a round (256)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; ratios are medians")
    p.add_argument("--threads", type=int, default=2, help="tier writer threads and raw I/O threads")
    p.add_argument("--recovery-pages", type=int, default=100_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="kv-bench-", dir=args.dir)
    rounds = []
    try:
        for r in range(args.rounds):  # raw and sidecar alternate, so disk drift hits both
            raw_w, raw_r = raw_write_read(base, args.pages * PAGE, args.threads)
            tier = os.path.join(base, f"tier{r}")
            side_w, side_r = sidecar_write_read(tier, args.pages, args.threads)
            shutil.rmtree(tier, ignore_errors=True)
            rounds.append((raw_w, raw_r, side_w, side_r))
        rec = recovery(os.path.join(base, "recovery"), args.recovery_pages)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = lambda i: statistics.median(x[i] for x in rounds)  # noqa: E731
    res = {
        "bytes": args.pages * PAGE,
        "threads": args.threads,
        "rounds": len(rounds),
        "raw_write_gbps": med(0),
        "raw_read_gbps": med(1),
        "write_through_gbps": med(2),
        "promotion_gbps": med(3),
        "write_ratio": statistics.median(x[2] / x[0] for x in rounds),
        "read_ratio": statistics.median(x[3] / x[1] for x in rounds),
        "recovery": rec,
    }
    side_w, side_r, raw_w, raw_r = med(2), med(3), med(0), med(1)
    mib = res["bytes"] / 2**20
    print(f"medians of {len(rounds)} rounds")
    print(
        f"write-through {mib:.0f} MiB, {args.threads} threads: {side_w:.2f} GB/s vs raw O_DIRECT write "
        f"{raw_w:.2f} GB/s -> {res['write_ratio']:.2f}x (target >= 0.7x)"
    )
    print(
        f"promotion {mib:.0f} MiB: {side_r:.2f} GB/s vs raw O_DIRECT read {raw_r:.2f} GB/s -> "
        f"{res['read_ratio']:.2f}x (target >= 0.7x)"
    )
    print(
        f"recovery of {rec['pages']} pages: index rebuilt in {rec['recover_s']:.2f} s; "
        f"process start to ready {rec['start_to_ready_s']:.2f} s"
    )
    if args.json:
        print(orjson.dumps(res).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
