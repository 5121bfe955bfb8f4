"""`python -m loadtest.micro.bench` (or `make bench`): the sidecar against its limits, in one run.

    exists, 1,000 keys        vs a bare FastAPI/uvicorn endpoint taking the same body:
                              req/s, server CPU per request (/proc/<pid>/stat), p99
    batch/exists, 3 extra pools  vs a single-pool exists: a whole hit of 600 of 1,000 keys,
                              and a partial one (KV 600, indexer 500, Mamba every 8th page
                              up to 500, SWA 500 with a window of 4)
    client exists, 1,000 keys vs a raw socket sending the same request
    shm set/get, 64 x 4 KiB   vs bare FastAPI set/get endpoints taking the same body (Unix
                              socket): req/s, server CPU per request, p99
    set/get via shm, 64 x 2 MiB pages a request  vs a torch copy of the same bytes with its
                              default threads (and a one-thread memmove, reported)
    inline PUT/GET of 2 MiB pages (GB/s, reported)

Every figure is a median; every ratio is against a limit measured in this same run. On a
shared machine client and server fight for the cores, so req/s swings between runs; CPU
per request is the steadier figure.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import statistics
import sys
import time

import orjson
import torch

from api.cli.stats import pct
from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.procs import Proc, start_bare, start_sidecar

TARGETS = {
    "exists": 1.0,
    "exists_p99": 1.2,
    "set": 1.0,
    "get": 1.0,
    "batch_exists": 0.9,
    "client": 1.2,
    "batch_partial": 0.9,
    "shm_set": 0.85,
    "shm_get": 0.85,
}


def _connect(url: str) -> socket.socket:
    """A raw socket to http://host:port (Nagle off) or unix:///path."""
    if url.startswith("unix://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(url[len("unix://") :])
        return sock
    host, port = url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def post_loop(url: str, path: str, body: bytes, n: int) -> list[float]:
    """Latencies of `n` sequential POSTs of `body` on one keep-alive socket.

    The request bytes are built once and the response is read with a minimal parser, so
    the load generator costs far less than either server (http.client would dominate)."""
    req = (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    lat = []
    with _connect(url) as sock:
        for _ in range(n):
            t = time.perf_counter()
            sock.sendall(req)
            _read_response(sock)
            lat.append(time.perf_counter() - t)
    return lat


def _read_response(sock: socket.socket) -> bytes:
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"unexpected answer: {head[:80]!r}")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += sock.recv(65536)
    return rest


def div(a: float, b: float) -> float:
    """a / b, 0.0 when b is 0 (a CPU delta under one clock tick in a quick run)."""
    return a / b if b else 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def task_cpu_seconds(pid: int) -> float:
    """CPU time of the process's live threads (schedstat: nanoseconds, where `cpu_seconds`
    counts 10 ms ticks). A thread gone between two readings takes its time with it: for
    servers whose threads live as long as they do (the sidecar's)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    return total / 1e9


def measure(
    server: Proc, path: str, body: bytes, n: int, url: str | None = None
) -> tuple[float, float, list[float]]:
    """(req/s, server CPU seconds a request, latencies) of `n` sequential POSTs to `url`
    (default: the server's TCP address)."""
    cpu = cpu_seconds(server.proc.pid)
    lat = post_loop(url or server.url, path, body, n)
    return n / sum(lat), (cpu_seconds(server.proc.pid) - cpu) / n, lat


def exists_keys(url: str, name: str) -> list[str]:
    """1,000 keys in a new namespace, the first 500 present (the lookup walks 500 keys)."""
    c = SidecarClient(url)
    c.put_namespace(name, 4096)
    keys = [f"{i:064x}" for i in range(1000)]
    for k in keys[:500]:
        c.put_page(name, k, b"\0" * 4096)
    return keys


def against_bare(
    sidecar: Proc, bare: Proc, path: str, body: bytes, n: int, rounds: int, unix: bool = False
) -> dict:
    """The same request to the sidecar and to the bare endpoint, in interleaved rounds."""
    side, bare_ = {"rps": [], "cpu": [], "lat": []}, {"rps": [], "cpu": [], "lat": []}
    for _ in range(rounds):  # interleave rounds so drift hits both alike
        for proc, acc in ((bare, bare_), (sidecar, side)):
            rps, cpu, lat = measure(proc, path, body, n, proc.socket_url if unix else proc.url)
            acc["rps"].append(rps)
            acc["cpu"].append(cpu)
            acc["lat"] += lat
    med = statistics.median
    return {
        "sidecar_rps": med(side["rps"]),
        "bare_rps": med(bare_["rps"]),
        "ratio": med([a / b for a, b in zip(side["rps"], bare_["rps"], strict=True)]),
        "cpu_us": med(side["cpu"]) * 1e6,
        "bare_cpu_us": med(bare_["cpu"]) * 1e6,
        "cpu_ratio": med([div(b, a) for a, b in zip(side["cpu"], bare_["cpu"], strict=True)]),
        "p50_ms": pct(side["lat"], 0.5) * 1e3,
        "p99_ms": pct(side["lat"], 0.99) * 1e3,
        "bare_p50_ms": pct(bare_["lat"], 0.5) * 1e3,
        "bare_p99_ms": pct(bare_["lat"], 0.99) * 1e3,
        "p99_ratio": div(pct(side["lat"], 0.99), pct(bare_["lat"], 0.99)),
    }


def bench_exists(sidecar: Proc, bare: Proc, n: int, rounds: int) -> dict:
    body = orjson.dumps({"keys": exists_keys(sidecar.url, "bench-exists")})
    return against_bare(sidecar, bare, "/v1/namespaces/bench-exists/exists", body, n, rounds)


def bench_moves(sidecar: Proc, bare: Proc, n: int, rounds: int, pages: int = 64) -> dict:
    """shm set and get of `pages` x 4 KiB pages over the Unix socket vs the bare endpoints
    (which parse the same body and answer the same shape). The set's keys are present after
    the first request, so it measures the request and the index, not a copy; the get copies
    the pages into the engine's buffer every time."""
    c = SidecarClient(sidecar.socket_url)
    c.put_namespace("bench-moves", 4096)
    buf = SharedBuffer(pages * 4096)
    buf.bytes.fill_(5)
    bid = buf.register(c, "bench-moves", pages, page_first_chunks(4096))
    body = orjson.dumps(
        {"keys": [f"{i:064x}" for i in range(pages)], "buffer_id": bid, "slots": list(range(pages))}
    )
    try:
        return {
            op: against_bare(
                sidecar, bare, f"/v1/namespaces/bench-moves/{op}", body, n, rounds, unix=True
            )
            for op in ("set", "get")
        }
    finally:
        c.delete_namespace("bench-moves")
        buf.close()


def bench_client(url: str, n: int, rounds: int) -> dict:
    """api.engine.client's `exists` of 1,000 keys, end to end, vs the same request on a raw socket."""
    c = SidecarClient(url)
    keys = exists_keys(url, "bench-client")
    body = orjson.dumps({"keys": keys})
    raw, client = [], []
    for _ in range(rounds):
        raw.append(statistics.median(post_loop(url, "/v1/namespaces/bench-client/exists", body, n)))
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            c.exists("bench-client", keys)
            lat.append(time.perf_counter() - t)
        client.append(statistics.median(lat))
    return {
        "client_ms": statistics.median(client) * 1e3,
        "raw_ms": statistics.median(raw) * 1e3,
        "ratio": statistics.median([a / b for a, b in zip(client, raw, strict=True)]),
    }


# batch/exists layouts: each pool's pages (indexes into the 1,000 keys) and the SWA window
WHOLE = {
    "kv": range(600),
    "mamba": range(600),
    "swa": range(600),
    "indexer": range(600),
    "window": 8,
}
PARTIAL = {
    "kv": range(600),
    "indexer": range(500),
    "mamba": range(0, 500, 8),
    "swa": range(500),
    "window": 4,
}


def bench_batch_exists(sidecar: Proc, n: int, rounds: int, layout: dict = WHOLE) -> dict:
    """batch/exists over 1,000 keys with three extra pools vs single-pool exists of the
    same KV pool, one run, with each pool holding what `layout` says."""
    c = SidecarClient(sidecar.url)
    keys = [f"{i:064x}" for i in range(1000)]
    pools = [
        ("bench-b-kv", "kv"),
        ("bench-b-mamba", "mamba"),
        ("bench-b-swa", "swa"),
        ("bench-b-idx", "indexer"),
    ]
    for name, kind in pools:
        c.put_namespace(name, 512, pool=kind)
        for i in layout[kind]:
            c.put_page(name, keys[i], b"\0" * 512)
    extra = [
        {"namespace": "bench-b-mamba", "policy": "trailing_pages", "window": 1},
        {"namespace": "bench-b-swa", "policy": "trailing_pages", "window": layout["window"]},
        {"namespace": "bench-b-idx", "policy": "all_pages"},
    ]
    single = orjson.dumps({"keys": keys})
    batch = orjson.dumps({"keys": keys, "kv": "bench-b-kv", "extra": extra})
    one, multi = [], []
    for _ in range(rounds):
        one.append(measure(sidecar, "/v1/namespaces/bench-b-kv/exists", single, n)[:2])
        multi.append(measure(sidecar, "/v1/batch/exists", batch, n)[:2])
    for name, _ in pools:
        c.delete_namespace(name)
    med = statistics.median
    return {
        "exists_rps": med(a for a, _ in one),
        "batch_rps": med(b for b, _ in multi),
        "ratio": med(b[0] / a[0] for a, b in zip(one, multi, strict=True)),
        "cpu_us": med(b for _, b in multi) * 1e6,
        "exists_cpu_us": med(a for _, a in one) * 1e6,
        "cpu_ratio": med(div(a[1], b[1]) for a, b in zip(one, multi, strict=True)),
    }


class Limits:
    """The limits for a move of `nbytes`, timed between the sidecar's moves (interleaved,
    so a slow minute on this shared machine hits both alike), between prefaulted buffers:
    a torch copy with torch's default threads (every core), and a stricter second one,
    a one-thread libc memmove."""

    def __init__(self, nbytes: int):
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.raw_src, self.raw_dst = bytearray(b"\1" * nbytes), bytearray(nbytes)
        self.csrc = (ctypes.c_char * nbytes).from_buffer(self.raw_src)
        self.cdst = (ctypes.c_char * nbytes).from_buffer(self.raw_dst)
        self.nbytes, self.copy_t, self.memmove_t = nbytes, [], []
        self.round(keep=False)

    def round(self, keep: bool = True) -> None:
        t = time.perf_counter()
        self.dst.copy_(self.src)
        t1 = time.perf_counter()
        ctypes.memmove(self.cdst, self.csrc, self.nbytes)
        t2 = time.perf_counter()
        if keep:
            self.copy_t.append(t1 - t)
            self.memmove_t.append(t2 - t1)

    def gbps(self) -> tuple[float, float]:
        """(torch copy, memmove) GB/s, each the median of the rounds."""
        return tuple(
            self.nbytes / statistics.median(t) / 1e9 for t in (self.copy_t, self.memmove_t)
        )

    def close(self) -> None:
        del self.csrc, self.cdst


def bench_shm(url: str, pages: int, page: int, reps: int) -> dict:
    c = SidecarClient(url)
    c.put_namespace("bench-shm", page)
    buf = SharedBuffer(pages * page)
    buf.bytes.fill_(7)  # prefault the engine side
    bid = buf.register(c, "bench-shm", pages, page_first_chunks(page))
    slots = list(range(pages))
    nbytes = pages * page
    limits = Limits(nbytes)
    set_t, get_t = [], []
    for r in range(reps + 1):
        keys = [f"r{r}-p{i}" for i in range(pages)]
        t = time.perf_counter()
        assert all(c.set("bench-shm", keys, bid, slots))
        t1 = time.perf_counter()
        assert all(c.get("bench-shm", keys, bid, slots))
        t2 = time.perf_counter()
        if r:  # the first round faults in nothing new but warms everything
            set_t.append(t1 - t)
            get_t.append(t2 - t1)
            limits.round()
    limit, memmove = limits.gbps()
    limits.close()
    set_gbps = nbytes / statistics.median(set_t) / 1e9
    get_gbps = nbytes / statistics.median(get_t) / 1e9
    c.delete_namespace("bench-shm")
    buf.close()
    return {
        "bytes_per_request": nbytes,
        "copy_gbps": limit,
        "copy_threads": torch.get_num_threads(),
        "memmove_gbps": memmove,
        "set_gbps": set_gbps,
        "get_gbps": get_gbps,
        "set_ratio": set_gbps / limit,
        "get_ratio": get_gbps / limit,
        "set_ratio_memmove": set_gbps / memmove,
        "get_ratio_memmove": get_gbps / memmove,
    }


def bench_inline(url: str, page: int, n: int) -> dict:
    c = SidecarClient(url)
    c.put_namespace("bench-inline", page)
    data = bytes(range(256)) * (page // 256)
    put_t, get_t = [], []
    for i in range(n):
        t = time.perf_counter()
        c.put_page("bench-inline", f"k{i}", data)
        t1 = time.perf_counter()
        assert c.get_page("bench-inline", f"k{i}") == data
        put_t.append(t1 - t)
        get_t.append(time.perf_counter() - t1)
    c.delete_namespace("bench-inline")
    return {
        "put_gbps": page / statistics.median(put_t) / 1e9,
        "get_gbps": page / statistics.median(get_t) / 1e9,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes (a smoke run, figures meaningless)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = p.parse_args(argv)
    # quick: 200 requests, so each server's CPU reading (10 ms ticks) spans several ticks
    n, rounds, pages, page, reps = (
        (200, 1, 4, 1 << 16, 2) if args.quick else (1500, 9, 64, 2 << 20, 15)
    )
    pool = "64MiB" if args.quick else "1GiB"
    sidecar, bare = start_sidecar("--host-pool", pool, "--no-file-tier"), start_bare()
    try:
        res = {
            "exists": bench_exists(sidecar, bare, n, rounds),
            "batch_exists": bench_batch_exists(sidecar, n, rounds),
            "batch_partial": bench_batch_exists(sidecar, n, rounds, PARTIAL),
            "moves": bench_moves(sidecar, bare, n, rounds),
            "client": bench_client(sidecar.url, n // 3 or 1, rounds),
            "client_uds": bench_client(sidecar.socket_url, n // 3 or 1, rounds),
            "shm": bench_shm(sidecar.socket_url, pages, page, reps),
            "inline": bench_inline(sidecar.url, page, max(reps * 2, 4)),
        }
    finally:
        sidecar.stop()
        bare.stop()
    report(res)
    if args.json:
        print(orjson.dumps(res).decode())
    return 0


def versus_line(label: str, e: dict, target: float) -> str:
    return (
        f"{label}: {e['sidecar_rps']:.0f} req/s, {e['cpu_us']:.0f} us CPU/request "
        f"(p50 {e['p50_ms']:.3f} ms, p99 {e['p99_ms']:.3f} ms) vs bare {e['bare_rps']:.0f} req/s, "
        f"{e['bare_cpu_us']:.0f} us CPU/request (p99 {e['bare_p99_ms']:.3f} ms) -> req/s {e['ratio']:.2f}x, "
        f"CPU {e['cpu_ratio']:.2f}x (bare CPU / ours; targets >= {target}x), "
        f"p99 {e['p99_ratio']:.2f}x of bare (target <= {TARGETS['exists_p99']}x)"
    )


def report(res: dict) -> None:
    e, s, i = res["exists"], res["shm"], res["inline"]
    print(versus_line("exists 1000 keys", e, TARGETS["exists"]))
    for op in ("set", "get"):
        print(
            versus_line(
                f"shm {op} 64 x 4 KiB (Unix socket{', pages present' if op == 'set' else ''})",
                res["moves"][op],
                TARGETS[op],
            )
        )
    for label, b, target in (
        ("whole hit", res["batch_exists"], "batch_exists"),
        ("partial hit", res["batch_partial"], "batch_partial"),
    ):
        print(
            f"batch/exists 1000 keys, kv + 3 extra pools, {label}: {b['batch_rps']:.0f} req/s, "
            f"{b['cpu_us']:.0f} us CPU vs single-pool exists {b['exists_rps']:.0f} req/s, "
            f"{b['exists_cpu_us']:.0f} us CPU -> req/s {b['ratio']:.2f}x, CPU {b['cpu_ratio']:.2f}x "
            f"(target >= {TARGETS[target]}x)"
        )
    for label, c in (("TCP", res["client"]), ("Unix socket", res["client_uds"])):
        print(
            f"client exists 1000 keys (api.engine.client, {label}): {c['client_ms']:.3f} ms vs raw "
            f"socket {c['raw_ms']:.3f} ms -> {c['ratio']:.2f}x (target <= {TARGETS['client']}x)"
        )
    mib = s["bytes_per_request"] / 2**20
    for op in ("set", "get"):
        print(
            f"shm {op} {mib:.0f} MiB/request: {s[op + '_gbps']:.2f} GB/s vs torch copy "
            f"({s['copy_threads']} threads) {s['copy_gbps']:.2f} GB/s -> {s[op + '_ratio']:.2f}x "
            f"(target >= {TARGETS['shm_' + op]}x); vs 1-thread memmove {s['memmove_gbps']:.2f} GB/s "
            f"-> {s[op + '_ratio_memmove']:.2f}x"
        )
    print(f"inline page PUT {i['put_gbps']:.2f} GB/s, GET {i['get_gbps']:.2f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
