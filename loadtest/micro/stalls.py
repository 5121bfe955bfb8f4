"""`python -m loadtest.micro.stalls`: how long the host pool's bookkeeping holds the event
loop when a tenant keeps its pages busy, each against the same work on a calm pool,
measured in the same run (the red-team round of stop 43; docs/security.md).

    full pool     a set's 4,096 reserves into a namespace whose every page is pinned
                  (each answers "no room")  vs  4,096 reserves + commits with room
    neighbour     4,096 reserves + commits of tenant B, below its share, beside tenant A
                  holding every other segment with one pinned page in each
                  vs  the same with A's pages unpinned and a free segment for B each time
    drop          dropping a namespace of N pages, one pinned  vs  storing them

Ratios are ours over the limit: below the target is better. The pools are real (a memfd
arena); no HTTP, no copy: what is measured is what runs on the event loop.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import orjson

from pools import Arena, HostPool

PAGE = 512
TARGETS = {"full_pool": 2.0, "neighbour": 4.0, "drop": 0.1}


class arena:
    """A real arena for one scenario, closed after it."""

    def __init__(self, pages: int):
        self.arena = Arena(pages * PAGE)

    def __enter__(self) -> HostPool:
        return HostPool(self.arena, self.arena.size // 64)  # 64 segments

    def __exit__(self, *exc) -> None:
        self.arena.close()


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def fill(pool, prefix: str, n: int) -> int:
    for i in range(n):
        e = pool.reserve(f"{prefix}{i:012x}")
        if e is None:
            return i
        pool.commit(e)
    return n


def reserves(pool, prefix: str, n: int, commit: bool) -> int:
    """`n` reserves of new keys (committed or not); how many had room."""
    got = 0
    for i in range(n):
        e = pool.reserve(f"{prefix}{i:012x}")
        if e is not None:
            got += 1
            if commit:
                pool.commit(e)
    return got


def full_pool(pages: int, keys: int) -> dict:
    with arena(pages) as host:
        pool = host.create("kv", PAGE, capacity_bytes=pages * PAGE)
        fill(pool, "k", pages)
        for key in list(pool.ready):
            pool.pin(key)
        stall = timed(lambda: reserves(pool, "x", keys, False))
        calm = host.create("calm", PAGE)
        host.drop("kv")
        limit = timed(lambda: reserves(calm, "y", keys, True))
    return {"ms": stall * 1e3, "limit_ms": limit * 1e3}


def neighbour(pages: int, keys: int) -> dict:
    """A fills every segment but B's one and pins a page in each; the limit: A fills half
    the arena, so B grows into free segments."""
    out = {}
    for pinned in (True, False):
        with arena(pages) as host:
            a = host.create("a", PAGE, owner=1)
            fill(a, "a", pages if pinned else pages // 2)
            b = host.create("b", PAGE, owner=2)
            fill(b, "b", 1)  # b holds one segment, below its share
            seen = set()
            for key, e in list(a.ready.items()) if pinned else ():
                if e.offset // host.segment_size not in seen:
                    seen.add(e.offset // host.segment_size)
                    a.pin(key)
            out["ms" if pinned else "limit_ms"] = (
                timed(lambda b=b: reserves(b, "n", keys, True)) * 1e3
            )
    return out


def drop(pages: int) -> dict:
    with arena(pages) as host:
        pool = host.create("kv", PAGE)
        limit = timed(lambda: fill(pool, "k", pages))
        pool.pin(next(iter(pool.ready)))
        return {"ms": timed(lambda: host.drop("kv")) * 1e3, "limit_ms": limit * 1e3}


def run(pages: int, keys: int) -> dict:
    res = {
        "full_pool": full_pool(pages, keys),
        "neighbour": neighbour(pages, keys),
        "drop": drop(pages),
    }
    for name, r in res.items():
        r["ratio"], r["target"] = r["ms"] / r["limit_ms"], TARGETS[name]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pages", type=int, default=65536, help="pages of the busy namespace (65,536)")
    p.add_argument("--keys", type=int, default=4096, help="keys of the set (4,096: the largest)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = run(args.pages, args.keys)
    for name, r in res.items():
        verdict = "met" if r["ratio"] <= r["target"] else "MISSED"
        print(
            f"{name}: {r['ms']:.1f} ms vs {r['limit_ms']:.1f} ms -> {r['ratio']:.2f}x "
            f"(target <= {r['target']}x: {verdict})"
        )
    if args.json:
        print(orjson.dumps(res).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
