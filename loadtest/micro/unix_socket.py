"""The engine socket against loopback TCP, and the cost of copying without a mapping.

    python -m loadtest.micro.unix_socket [--rounds 5] [--json]

One sidecar process; in interleaved rounds, through `api.engine.client`:
- `exists` of 1,000 keys over the Unix socket and over TCP (req/s, p50, p99);
- moving 16 x 64 KiB pages a request: shm set/get over the socket (the engine path)
  against inline PUT/GET of the same pages over TCP (the only way a TCP caller moves pages);
- shm set/get of 64 x 2 MiB a request from a sealed memfd (mmap + memmove) and from an
  unsealable memfd, as SGLang's allocator makes (pread/pwrite on the fd: no SIGBUS).
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
import time

import orjson

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.procs import start_sidecar
from loadtest.micro.bench import cpu_seconds


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def summary(lat: list[float], nbytes: int = 0) -> dict:
    total = sum(lat)
    row = {"req_s": len(lat) / total, "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3}
    if nbytes:
        row["gb_s"] = nbytes * len(lat) / total / 1e9
    return row


def bench_exists(uds: SidecarClient, tcp: SidecarClient, rounds: int, n: int, pid: int) -> dict:
    """Per listener: req/s, p50, p99, and the server's CPU per request (/proc/<pid>/stat)."""
    keys = [f"k{i}" for i in range(1000)]
    uds.put_namespace("bs-exists", 4096)
    lat, cpu = {"uds": [], "tcp": []}, {"uds": 0.0, "tcp": 0.0}
    for _ in range(rounds):
        for name, c in (("tcp", tcp), ("uds", uds)):
            before = cpu_seconds(pid)
            lat[name] += timed(lambda c=c: c.exists("bs-exists", keys), n)
            cpu[name] += cpu_seconds(pid) - before
    return {k: {**summary(v), "cpu_us": cpu[k] / len(v) * 1e6} for k, v in lat.items()}


def bench_small_moves(uds: SidecarClient, tcp: SidecarClient, rounds: int, n: int) -> dict:
    page, pages = 64 << 10, 16
    uds.put_namespace("bs-small", page)
    buf = SharedBuffer(pages * page)
    buf.bytes.fill_(3)
    bid = buf.register(uds, "bs-small", pages, page_first_chunks(page))
    slots, data = list(range(pages)), bytes(buf.view(0, page))
    lat = {k: [] for k in ("uds_shm_set", "uds_shm_get", "tcp_inline_put", "tcp_inline_get")}
    for r in range(rounds):
        for i in range(n):
            keys = [f"r{r}-{i}-{j}" for j in range(pages)]
            lat["uds_shm_set"] += timed(lambda keys=keys: uds.set("bs-small", keys, bid, slots), 1)
            lat["uds_shm_get"] += timed(lambda keys=keys: uds.get("bs-small", keys, bid, slots), 1)
            tkeys = [k + "t" for k in keys]
            lat["tcp_inline_put"] += timed(
                lambda tkeys=tkeys: [tcp.put_page("bs-small", k, data) for k in tkeys], 1
            )
            lat["tcp_inline_get"] += timed(
                lambda tkeys=tkeys: [tcp.get_page("bs-small", k) for k in tkeys], 1
            )
    return {k: summary(v, pages * page) for k, v in lat.items()}


def bench_copy_modes(uds: SidecarClient, rounds: int) -> dict:
    page, pages = 2 << 20, 64
    uds.put_namespace("bs-big", page)
    bufs = {"mmap": SharedBuffer(pages * page), "fd": SharedBuffer(pages * page, sealable=False)}
    bids = {}
    for mode, buf in bufs.items():
        buf.bytes.fill_(5)
        bids[mode] = buf.register(uds, "bs-big", pages, page_first_chunks(page))
    slots, lat = list(range(pages)), {}
    for r in range(rounds):
        for mode in bufs:
            keys = [f"{mode}-{r}-{i}" for i in range(pages)]
            lat.setdefault(f"{mode}_set", []).extend(
                timed(lambda keys=keys, mode=mode: uds.set("bs-big", keys, bids[mode], slots), 1)
            )
            lat.setdefault(f"{mode}_get", []).extend(
                timed(lambda keys=keys, mode=mode: uds.get("bs-big", keys, bids[mode], slots), 1)
            )
            uds.delete("bs-big", keys)
    return {k: summary(v, pages * page) for k, v in lat.items()}


def run(rounds: int, n: int) -> dict:
    # the token on both listeners; on TCP it makes the caller the operator, who reaches the
    # namespaces made on the engine socket (docs/security.md); without it, only its own
    token = secrets.token_hex(16)
    with tempfile.NamedTemporaryFile("w", suffix=".token", delete=False) as f:
        f.write(token)
    os.chmod(f.name, 0o600)
    side = start_sidecar("--host-pool", "1GiB", "--no-file-tier", "--token-file", f.name)
    try:
        uds = SidecarClient(side.socket_url, timeout=120, token=token)
        tcp = SidecarClient(side.url, timeout=120, token=token)
        res = {
            "exists": bench_exists(uds, tcp, rounds, n, side.proc.pid),
            "small_moves": bench_small_moves(uds, tcp, rounds, max(n // 10, 5)),
            "copy_modes": bench_copy_modes(uds, rounds),
        }
    finally:
        side.stop()
        os.unlink(f.name)
    e, m, s = res["exists"], res["copy_modes"], res["small_moves"]
    res["ratios"] = {
        "exists_uds_vs_tcp_req_s": e["uds"]["req_s"] / e["tcp"]["req_s"],
        "exists_uds_vs_tcp_p99": e["uds"]["p99_ms"] / e["tcp"]["p99_ms"],
        "small_set_uds_shm_vs_tcp_inline_gb_s": s["uds_shm_set"]["gb_s"]
        / s["tcp_inline_put"]["gb_s"],
        "small_get_uds_shm_vs_tcp_inline_gb_s": s["uds_shm_get"]["gb_s"]
        / s["tcp_inline_get"]["gb_s"],
        "fd_vs_mmap_set_gb_s": m["fd_set"]["gb_s"] / m["mmap_set"]["gb_s"],
        "fd_vs_mmap_get_gb_s": m["fd_get"]["gb_s"] / m["mmap_get"]["gb_s"],
    }
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=200, help="exists calls per round and listener")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = run(args.rounds, args.n)
    if args.json:
        print(orjson.dumps(res, option=orjson.OPT_INDENT_2).decode())
        return
    for group in ("exists", "small_moves", "copy_modes"):
        for name, row in res[group].items():
            cells = "  ".join(f"{k} {v:,.2f}" for k, v in row.items())
            print(f"{group:12} {name:15} {cells}")
    for k, v in res["ratios"].items():
        print(f"ratio {k:40} {v:.2f}x")


if __name__ == "__main__":
    main()
