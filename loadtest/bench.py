"""`python -m loadtest.bench` (or `make bench`): the sidecar against its limits, in one run.

    exists, 1,000 keys        vs a bare FastAPI/uvicorn endpoint taking the same body
    set/get via shm, 64 x 2 MiB pages a request  vs a one-thread torch copy of the same bytes
    inline PUT/GET of 2 MiB pages (GB/s, reported)

Every figure is a median; every ratio is against a limit measured in this same run.
"""
from __future__ import annotations

import argparse
import ctypes
import socket
import statistics
import sys
import time

import orjson
import torch

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.procs import start_bare, start_sidecar

TARGETS = {"exists": 0.7, "shm_set": 0.75, "shm_get": 0.75, "batch_exists": 0.8}


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values` (0.0 for none)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def post_loop(url: str, path: str, body: bytes, n: int) -> list[float]:
    """Latencies of `n` sequential POSTs of `body` on one keep-alive socket.

    The request bytes are built once and the response is read with a minimal parser, so
    the load generator costs far less than either server (http.client would dominate)."""
    host, port = url.split("//")[1].split(":")
    req = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    lat = []
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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


def bench_exists(sidecar_url: str, bare_url: str, n: int, rounds: int) -> dict:
    c = SidecarClient(sidecar_url)
    c.put_namespace("bench-exists", 4096)
    keys = [f"{i:064x}" for i in range(1000)]
    for i in range(0, 1000, 100):  # half present, so the lookup walks 500 keys
        if i < 500:
            for k in keys[i:i + 100]:
                c.put_page("bench-exists", k, b"\0" * 4096)
    body = orjson.dumps({"keys": keys})
    path = "/v1/namespaces/bench-exists/exists"
    side_rps, bare_rps, ratios, side_lat, bare_lat = [], [], [], [], []
    for _ in range(rounds):  # interleave rounds so drift hits both alike
        lat = post_loop(bare_url, path, body, n)
        bare_rps.append(n / sum(lat))
        bare_lat += lat
        lat = post_loop(sidecar_url, path, body, n)
        side_rps.append(n / sum(lat))
        side_lat += lat
        ratios.append(side_rps[-1] / bare_rps[-1])
    side, bare = statistics.median(side_rps), statistics.median(bare_rps)
    return {"sidecar_rps": side, "bare_rps": bare, "ratio": statistics.median(ratios),
            "p50_ms": pct(side_lat, 0.5) * 1e3, "p99_ms": pct(side_lat, 0.99) * 1e3,
            "bare_p50_ms": pct(bare_lat, 0.5) * 1e3, "bare_p99_ms": pct(bare_lat, 0.99) * 1e3}


def bench_batch_exists(url: str, n: int, rounds: int) -> dict:
    """batch/exists over 1,000 keys with three extra pools vs single-pool exists, one run."""
    c = SidecarClient(url)
    keys = [f"{i:064x}" for i in range(1000)]
    pools = [("bench-b-kv", "kv"), ("bench-b-mamba", "mamba"), ("bench-b-swa", "swa"),
             ("bench-b-idx", "indexer")]
    for name, kind in pools:
        c.put_namespace(name, 256, pool=kind)
        for k in keys[:600]:
            c.put_page(name, k, b"\0" * 256)
    extra = [{"namespace": "bench-b-mamba", "policy": "trailing_pages", "window": 1},
             {"namespace": "bench-b-swa", "policy": "trailing_pages", "window": 8},
             {"namespace": "bench-b-idx", "policy": "all_pages"}]
    single = orjson.dumps({"keys": keys})
    batch = orjson.dumps({"keys": keys, "kv": "bench-b-kv", "extra": extra})
    one, multi, ratios = [], [], []
    for _ in range(rounds):
        a = n / sum(post_loop(url, "/v1/namespaces/bench-b-kv/exists", single, n))
        b = n / sum(post_loop(url, "/v1/batch/exists", batch, n))
        one.append(a)
        multi.append(b)
        ratios.append(b / a)
    for name, _ in pools:
        c.delete_namespace(name)
    return {"exists_rps": statistics.median(one), "batch_rps": statistics.median(multi),
            "ratio": statistics.median(ratios)}


def torch_copy_gbps(nbytes: int, reps: int) -> float:
    """The limit: one-thread torch copy of the same bytes between prefaulted buffers."""
    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def memmove_gbps(nbytes: int, reps: int) -> float:
    """A second, stricter limit: one-thread libc memmove of the same bytes."""
    src, dst = bytearray(b"\1" * nbytes), bytearray(nbytes)
    csrc = (ctypes.c_char * nbytes).from_buffer(src)
    cdst = (ctypes.c_char * nbytes).from_buffer(dst)
    ctypes.memmove(cdst, csrc, nbytes)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        ctypes.memmove(cdst, csrc, nbytes)
        times.append(time.perf_counter() - t)
    del csrc, cdst
    return nbytes / statistics.median(times) / 1e9


def bench_shm(url: str, pages: int, page: int, reps: int) -> dict:
    c = SidecarClient(url)
    c.put_namespace("bench-shm", page)
    buf = SharedBuffer(pages * page)
    buf.bytes.fill_(7)  # prefault the engine side
    bid = buf.register(c, "bench-shm", pages, page_first_chunks(page))
    slots = list(range(pages))
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
    nbytes = pages * page
    limit = torch_copy_gbps(nbytes, max(reps, 5))
    memmove = memmove_gbps(nbytes, max(reps, 5))
    set_gbps = nbytes / statistics.median(set_t) / 1e9
    get_gbps = nbytes / statistics.median(get_t) / 1e9
    c.delete_namespace("bench-shm")
    buf.close()
    return {"bytes_per_request": nbytes, "copy_gbps": limit, "memmove_gbps": memmove,
            "set_gbps": set_gbps, "get_gbps": get_gbps, "set_ratio": set_gbps / limit,
            "get_ratio": get_gbps / limit, "set_ratio_memmove": set_gbps / memmove,
            "get_ratio_memmove": get_gbps / memmove}


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
    return {"put_gbps": page / statistics.median(put_t) / 1e9,
            "get_gbps": page / statistics.median(get_t) / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run, figures meaningless)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = p.parse_args(argv)
    n, rounds, pages, page, reps = (50, 1, 4, 1 << 16, 2) if args.quick else (1500, 9, 64, 2 << 20, 15)
    pool = "64MiB" if args.quick else "1GiB"
    sidecar, bare = start_sidecar("--host-pool", pool, "--no-file-tier"), start_bare()
    try:
        res = {"exists": bench_exists(sidecar.url, bare.url, n, rounds),
               "batch_exists": bench_batch_exists(sidecar.url, n, rounds),
               "shm": bench_shm(sidecar.url, pages, page, reps),
               "inline": bench_inline(sidecar.url, page, max(reps * 2, 4))}
    finally:
        sidecar.stop()
        bare.stop()
    report(res)
    if args.json:
        print(orjson.dumps(res).decode())
    return 0


def report(res: dict) -> None:
    e, s, i = res["exists"], res["shm"], res["inline"]
    print(f"exists 1000 keys: {e['sidecar_rps']:.0f} req/s (p50 {e['p50_ms']:.3f} ms, p99 {e['p99_ms']:.3f} ms)"
          f" vs bare {e['bare_rps']:.0f} req/s -> {e['ratio']:.2f}x, median of per-round ratios (target >= {TARGETS['exists']}x, p99 < 1 ms)")
    mib = s["bytes_per_request"] / 2**20
    for op in ("set", "get"):
        print(f"shm {op} {mib:.0f} MiB/request: {s[op + '_gbps']:.2f} GB/s vs torch 1-thread copy "
              f"{s['copy_gbps']:.2f} GB/s -> {s[op + '_ratio']:.2f}x (target >= {TARGETS['shm_' + op]}x); "
              f"vs memmove {s['memmove_gbps']:.2f} GB/s -> {s[op + '_ratio_memmove']:.2f}x")
    b = res["batch_exists"]
    print(f"batch/exists 1000 keys, kv + 3 extra pools: {b['batch_rps']:.0f} req/s vs single-pool exists "
          f"{b['exists_rps']:.0f} req/s -> {b['ratio']:.2f}x (target >= {TARGETS['batch_exists']}x)")
    print(f"inline page PUT {i['put_gbps']:.2f} GB/s, GET {i['get_gbps']:.2f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
