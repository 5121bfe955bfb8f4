"""cProfile of the app alone (no sockets), for issue 13: exists of 1,000 keys (500 present),
batch/exists with 3 extra pools (600 present), and the bare FastAPI endpoint, called in process.

    PYTHONPATH=$PWD python docs/perf/exists_profile.py LABEL bare|exists|exists600|batch [N]
"""

import asyncio
import cProfile
import io
import pstats
import sys
import time

import orjson

from api.app import create_app
from loadtest.micro.bare_app import create_bare_app
from sidecar.config import Config
from sidecar.spec import parse_spec

label, what = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
keys = [f"{i:064x}" for i in range(1000)]
EXTRA = [
    {"namespace": "mamba", "policy": "trailing_pages", "window": 1},
    {"namespace": "swa", "policy": "trailing_pages", "window": 8},
    {"namespace": "idx", "policy": "all_pages"},
]
if what == "batch":
    PATH, BODY = "/v1/batch/exists", orjson.dumps({"keys": keys, "kv": "kv", "extra": EXTRA})
else:
    PATH, BODY = "/v1/namespaces/kv/exists", orjson.dumps({"keys": keys})
SCOPE = {
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "POST",
    "scheme": "http",
    "path": PATH,
    "raw_path": PATH.encode(),
    "query_string": b"",
    "root_path": "",
    "headers": [
        (b"host", b"x"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
    ],
    "client": ("127.0.0.1", 1),
    "server": ("127.0.0.1", 2),
}


async def receive():
    return {"type": "http.request", "body": BODY, "more_body": False}


async def one(app):
    out = []

    async def send(m):
        out.append(m)

    await app(dict(SCOPE), receive, send)
    assert out[0]["status"] == 200, out


async def run(app):
    for _ in range(300):
        await one(app)
    best = []
    for _ in range(5):
        t = time.process_time()
        for _ in range(N // 5):
            await one(app)
        best.append((time.process_time() - t) / (N // 5))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(N):
        await one(app)
    pr.disable()
    return min(best), pr


async def main():
    if what == "bare":
        app = create_bare_app()
        plain, pr = await run(app)
    else:
        app = create_app(Config(port=1, host_pool=64 * 2**20, segment_size=2**20, file_tier=False))
        async with app.router.lifespan_context(app):
            ctx = app.state.ctx
            while not ctx.ready:
                await asyncio.sleep(0.01)
            for name, kind in (
                ("kv", "kv"),
                ("mamba", "mamba"),
                ("swa", "swa"),
                ("idx", "indexer"),
            ):
                ctx.store.put_namespace(name, parse_spec({"page_bytes": 256, "pool": kind}))
                pool = ctx.store.namespace(name).pool
                for k in keys[: 600 if what in ("batch", "exists600") else 500]:
                    pool.commit(pool.reserve(k))
            plain, pr = await run(app)
    s = io.StringIO()
    print(
        f"==== {label}: {what} {PATH}: {plain * 1e6:.0f} us CPU a request unprofiled (best of 5 x {N // 5}) ====",
        file=s,
    )
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(25)
    print(s.getvalue())


asyncio.run(main())
