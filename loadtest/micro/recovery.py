"""`make bench-recovery` (`python -m loadtest.micro.recovery`): the file tier's index rebuilt
from 1,000,000 page files, in one run.

    files:    N small pages written straight in the tier's on-disk format (pagefile.py), by
              a few processes, over a few identity directories, in a temp dir removed after
    recover:  FileTier.recover() in process (median of rounds), with its peak
    memory:   the index's Python memory per page (tracemalloc, in a child process)
    ready:    `sidecar serve` from process start to /readyz 200 on that directory, with
              --file-tier-size, and on the default size (which sums what the directory holds)

The page cache is warm (the files were just written): a restart after a reboot also reads
the directory from disk. The target is ready in under 10 s for 1,000,000 pages.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import orjson

from loadtest.kit.procs import start_sidecar
from sidecar.tiers import pagefile
from sidecar.tiers.file_tier import FileTier

TARGET_S = 10.0
_MEMORY = """
import gc, sys, tracemalloc
from sidecar.tiers.file_tier import FileTier
gc.collect()
tracemalloc.start()
tier = FileTier("file", sys.argv[1])
n = tier.recover()
gc.collect()
now, peak = tracemalloc.get_traced_memory()
print(n, now, peak)
"""


def identity(i: int) -> str:
    return f"{i:032x}"


def key_of(i: int) -> str:
    return f"{i:064x}"  # a 256-bit hash in hex, as engines name pages


def _write_range(job: tuple[str, int, int, int, int]) -> int:
    """Write pages [lo, hi) round-robin over `idents` directories; fsync nothing (only the
    scan is measured). Each file: header + page, exactly as the tier publishes it."""
    root, lo, hi, idents, page_bytes = job
    page = bytes([7]) * page_bytes
    dirs = [os.path.join(root, identity(d)) for d in range(idents)]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for i in range(lo, hi):
        key = key_of(i)
        fd = os.open(os.path.join(dirs[i % idents], pagefile.page_name(key)), flags, 0o600)
        try:
            os.write(fd, pagefile.encode_header(key, page) + page)
        finally:
            os.close(fd)
    return hi - lo


def make_pages(root: str, n: int, idents: int, page_bytes: int, workers: int) -> float:
    """Write `n` page files under `root`; return the seconds it took."""
    t = time.perf_counter()
    os.makedirs(root, 0o700, exist_ok=True)
    for d in range(idents):
        os.mkdir(os.path.join(root, identity(d)), 0o700)
    step = -(-n // (workers * 8))
    jobs = [(root, lo, min(lo + step, n), idents, page_bytes) for lo in range(0, n, step)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        assert sum(pool.map(_write_range, jobs)) == n
    return time.perf_counter() - t


def recover_times(root: str, n: int, rounds: int, page_bytes: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of `rounds` in-process recoveries, each checked."""
    times = []
    for _ in range(rounds):
        tier = FileTier("file", root)
        t, cpu = time.perf_counter(), time.process_time()
        assert tier.recover() == n
        times.append((time.perf_counter() - t, time.process_time() - cpu))
        assert tier.used == n * (pagefile.HEADER_SIZE + page_bytes) and tier.pages() == n, tier.used
        buf = bytearray(page_bytes)
        for i in (0, n // 2, n - 1):  # the index points at real, valid pages
            assert tier.read(identity(i % len(tier.keys)), key_of(i), memoryview(buf))
            assert buf == bytes([7]) * page_bytes
        del tier
    return times


def index_memory(root: str, n: int) -> tuple[int, int]:
    """(bytes the index keeps, peak bytes while building it), in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY, root],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout.split()
    assert int(out[0]) == n, out
    return int(out[1]), int(out[2])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_to_ready(root: str, *args: str) -> tuple[float, float]:
    """(wall seconds from process start to /readyz 200, the sidecar's CPU seconds by then)."""
    t = time.perf_counter()
    proc = start_sidecar("--host-pool", "64MiB", "--data-dir", root, *args)
    ready, cpu = time.perf_counter() - t, cpu_seconds(proc.proc.pid)
    proc.stop()
    return ready, cpu


def measure(root: str, args) -> dict:
    n = args.pages
    write_s = 0.0
    if not args.tier:
        write_s = make_pages(root, n, args.identities, args.page_bytes, args.workers)
        print(
            f"wrote {n} pages of {args.page_bytes} bytes in {args.identities} directories "
            f"in {write_s:.1f} s",
            flush=True,
        )
    rounds = recover_times(root, n, args.rounds, args.page_bytes)
    print(f"in process (wall, CPU seconds): {rounds}", flush=True)
    kept, peak = index_memory(root, n)
    ready = sorted(start_to_ready(root, "--file-tier-size", "1TiB") for _ in range(args.rounds))
    print(f"start to ready (wall, CPU seconds): {ready}", flush=True)
    ready_default = start_to_ready(root)
    return {
        "pages": n,
        "identities": args.identities,
        "page_bytes": args.page_bytes,
        "write_s": write_s,
        "recover_s": statistics.median(w for w, _ in rounds),
        "recover_cpu_s": statistics.median(c for _, c in rounds),
        "recover_rounds": rounds,
        "index_bytes_per_page": kept / n,
        "peak_bytes_per_page": peak / n,
        "ready_s": ready[len(ready) // 2][0],
        "ready_cpu_s": ready[len(ready) // 2][1],
        "ready_rounds": ready,
        "ready_default_size_s": ready_default[0],
        "ready_default_size_cpu_s": ready_default[1],
        "target_s": TARGET_S,
        "loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def report(res: dict) -> None:
    n, target = res["pages"], res["target_s"]
    print(
        f"recover {n} pages in process: {res['recover_s']:.2f} s, {res['recover_cpu_s']:.2f} s "
        f"of CPU (medians of {len(res['recover_rounds'])})"
    )
    print(
        f"index memory: {res['index_bytes_per_page']:.0f} bytes a page kept "
        f"({res['index_bytes_per_page'] * n / 2**20:.0f} MiB), "
        f"{res['peak_bytes_per_page']:.0f} bytes a page at peak"
    )
    for what, s, cpu in (
        ("--file-tier-size 1TiB, median", res["ready_s"], res["ready_cpu_s"]),
        ("default size", res["ready_default_size_s"], res["ready_default_size_cpu_s"]),
    ):
        print(
            f"process start to ready ({what}): {s:.2f} s ({cpu:.2f} s of the sidecar's CPU) -> "
            f"{s / target:.2f} of the {target:.0f} s target ({'met' if s < target else 'MISSED'})"
        )
    print(
        "load average while measuring: {:.2f} {:.2f} {:.2f} on {:d} CPUs".format(
            *res["loadavg"], res["cpus"]
        )
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pages", type=int, default=1_000_000)
    p.add_argument("--identities", type=int, default=4, help="namespace directories (4)")
    p.add_argument("--page-bytes", type=int, default=512, help="page size (512, the smallest)")
    p.add_argument("--rounds", type=int, default=3, help="recoveries and starts; medians count")
    p.add_argument("--workers", type=int, default=2, help="processes writing the files")
    p.add_argument("--dir", help="a directory on the disk to measure (default: a temp dir)")
    p.add_argument(
        "--keep", action="store_true", help="keep the pages written (the path is printed)"
    )
    p.add_argument("--tier", help="measure the pages a --keep run left there instead of writing")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    base = None if args.tier else tempfile.mkdtemp(prefix="kv-bench-recovery-", dir=args.dir)
    try:
        res = measure(args.tier or os.path.join(base, "tier"), args)
        report(res)
        if args.json:
            print(orjson.dumps(res).decode(), flush=True)
    finally:
        if args.keep and base:
            print(f"kept {base}/tier: --tier {base}/tier measures it again")
        elif base:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
