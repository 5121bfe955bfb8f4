"""py-spy of a running sidecar under one hot request, for issue 13: `get` of 64 x 4 KiB
pages over the engine socket, `batch/exists` of 1,000 keys with three extra pools, or
`exists` of 1,000 keys (500 present). Prints the frames by inclusive share of samples.

    PYTHONPATH=$PWD PATH=$PWD/.venv/bin:$PATH python docs/perf/pyspy_hot.py get|batch|exists [SECONDS]
"""

import collections
import subprocess
import sys
import tempfile
import time

import orjson

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks
from loadtest.kit.procs import start_sidecar
from loadtest.micro.bench import exists_keys, measure, post_loop

EXTRA = [
    {"namespace": "mamba", "policy": "trailing_pages", "window": 1},
    {"namespace": "swa", "policy": "trailing_pages", "window": 8},
    {"namespace": "idx", "policy": "all_pages"},
]


def request(sc, what: str):
    """(url, path, body) of the request to drive, its pages stored first."""
    if what == "get":
        c = SidecarClient(sc.socket_url)
        c.put_namespace("m", 4096)
        buf = SharedBuffer(64 * 4096)
        buf.bytes.fill_(5)
        body = orjson.dumps(
            {
                "keys": [f"{i:064x}" for i in range(64)],
                "slots": list(range(64)),
                "buffer_id": buf.register(c, "m", 64, page_first_chunks(4096)),
            }
        )
        post_loop(sc.socket_url, "/v1/namespaces/m/set", body, 1)
        request.keep = buf
        return sc.socket_url, "/v1/namespaces/m/get", body
    if what == "exists":
        return sc.url, "/v1/namespaces/kv/exists", orjson.dumps({"keys": exists_keys(sc.url, "kv")})
    c, keys = SidecarClient(sc.url), [f"{i:064x}" for i in range(1000)]
    for name, kind in (("kv", "kv"), ("mamba", "mamba"), ("swa", "swa"), ("idx", "indexer")):
        c.put_namespace(name, 256, pool=kind)
        for k in keys[:600]:
            c.put_page(name, k, b"\0" * 256)
    return sc.url, "/v1/batch/exists", orjson.dumps({"keys": keys, "kv": "kv", "extra": EXTRA})


def top(raw: str, n: int = 40) -> list[str]:
    own, incl, total = collections.Counter(), collections.Counter(), 0
    with open(raw) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            frames, count = stack.split(";"), int(count)
            total += count
            own[frames[-1]] += count
            for f in set(frames):
                incl[f] += count
    skip = (
        "runpy",
        "sidecar/__main__",
        "sidecar/cli.py",
        "sidecar/server.py",
        "uvicorn/server.py",
        "uvicorn/_compat.py",
    )
    rows = [f for f, _ in incl.most_common() if not any(s in f for s in skip)][:n]
    return [
        f"{100 * incl[f] / total:5.1f}% incl {100 * own[f] / total:5.1f}% own  {f}" for f in rows
    ]


def main(what: str, seconds: int) -> None:
    sc = start_sidecar("--host-pool", "1GiB", "--no-file-tier")
    try:
        url, path, body = request(sc, what)
        rps, cpu, _ = measure(sc, path, body, 2000, url)
        print(f"# {what}: {rps:.0f} req/s, {cpu * 1e6:.0f} us server CPU a request (unprofiled)")
        with tempfile.NamedTemporaryFile(suffix=".raw") as out:
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-p",
                    str(sc.proc.pid),
                    "-r",
                    "500",
                    "-d",
                    str(seconds),
                    "-f",
                    "raw",
                    "-o",
                    out.name,
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            end = time.time() + seconds + 1
            while time.time() < end:
                post_loop(url, path, body, 500)
            spy.wait()
            print("\n".join(top(out.name)))
    finally:
        sc.stop()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8)
