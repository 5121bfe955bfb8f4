"""`python -m loadtest.micro.mooncake_store`: the sidecar's Mooncake tier against the Mooncake
client's own batch calls, same bytes, same cluster, same run.

    write-through: host-pool slots -> Tiering.write_through -> TierWriter -> MooncakeTier
                   (header + checksum, batch_put_from_multi_buffers)
              vs   batch_put_from of the same N pages from a registered buffer
    promotion:     Tiering.promote into an empty namespace (batch_is_exist, reserve,
                   batch_get_into_multi_buffers, checksum, commit)
              vs   batch_get_into of the same N pages into a registered buffer

A loopback cluster: mooncake_master plus one store node lending the segment; both clients
lend nothing, so every byte crosses the transfer engine to the store node and back. A
warm-up round is not counted; raw and tier alternate which goes first in each round.
Prints median GB/s and the median of per-round tier/raw ratios (target >= 0.8x); --json
for one line.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import orjson

from loadtest.kit.mooncake_cluster import Master, StoreNode
from pools import Arena, HostPool
from sidecar.tiering import Tiering
from sidecar.tiers.mooncake_tier import MooncakeSettings, MooncakeTier
from sidecar.tiers.writer import TierWriter

PAGE = 2 << 20


def raw_client(master: Master, size: int):
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
    buf = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert client.register_buffer(addr, size) == 0
    return client, buf, addr


def raw_round(client, addr: int, keys: list[str]) -> tuple[float, float]:
    ptrs, sizes = [addr + i * PAGE for i in range(len(keys))], [PAGE] * len(keys)
    t0 = time.perf_counter()
    assert all(c == 0 for c in client.batch_put_from(keys, ptrs, sizes))
    t1 = time.perf_counter()
    assert all(c == PAGE for c in client.batch_get_into(keys, ptrs, sizes))
    t2 = time.perf_counter()
    client.batch_remove(keys, True)
    return t1 - t0, t2 - t1


async def tier_round(
    tiering: Tiering, host: HostPool, keys: list[str], payload: bytes, name: str
) -> tuple[float, float]:
    ident = "b" * 32
    # a pool twice the burst: write-through's back-pressure (half a pool pinned) stays out
    src = host.create(name + "-w", PAGE, 2 * len(keys) * PAGE)
    entries = []
    for i, k in enumerate(keys):
        e = src.reserve(k)
        host.view(e.offset, PAGE)[:] = payload[i * PAGE : (i + 1) * PAGE]
        src.commit(e)
        entries.append(e)
    t0 = time.perf_counter()
    futures = await tiering.write_through(ident, src, entries)
    assert all(await asyncio.gather(*futures))
    t1 = time.perf_counter()
    host.drop(src.name)
    dst = host.create(name + "-r", PAGE, len(keys) * PAGE)
    t2 = time.perf_counter()
    got = await tiering.promote(ident, dst, keys)
    assert got == len(keys), (got, tiering.tiers[0].describe())
    t3 = time.perf_counter()
    for i, k in enumerate(keys):  # byte-exact, outside the timing
        e = dst.pin(k)
        assert host.view(e.offset, PAGE) == payload[i * PAGE : (i + 1) * PAGE]
        dst.unpin(e)
    host.drop(dst.name)
    await asyncio.get_running_loop().run_in_executor(None, tiering.tiers[0].delete, ident, keys)
    return t1 - t0, t3 - t2


async def run(args) -> dict:
    n, total = args.pages, args.pages * PAGE
    master = Master().start()
    node = StoreNode(master, f"{max(1, 3 * total >> 30)}GB").start()
    arena = Arena(3 * total + (16 << 20))
    try:
        host = HostPool(arena, PAGE * 8)
        executor = ThreadPoolExecutor(4)
        mtier = MooncakeTier(MooncakeSettings(master.address, segment_size=0))
        mtier.attach(arena.address, arena.size)
        mtier.recover()
        while not mtier.connected:
            await asyncio.sleep(0.05)
        writer = TierWriter([mtier], args.threads, 4 * n)
        writer.start()
        tiering = Tiering([mtier], "write_through", writer, host, executor)
        client, buf, addr = raw_client(master, total)
        payload = os.urandom(total)
        buf[:] = payload
        res = {"tier_put": [], "tier_get": [], "raw_put": [], "raw_get": []}
        for r in range(-1, args.rounds):  # round -1 warms the store node's segment up

            async def tier_side(r: int = r) -> tuple[float, float]:
                return await tier_round(
                    tiering, host, [f"t{r}-{i}" for i in range(n)], payload, f"r{r}"
                )

            raw_keys = [f"raw{r}-{i}" for i in range(n)]
            if r % 2:  # alternate which side goes first: no order bias
                tier = await tier_side()
                raw = raw_round(client, addr, raw_keys)
            else:
                raw = raw_round(client, addr, raw_keys)
                tier = await tier_side()
            if r >= 0:
                for side, (p, g) in (("raw", raw), ("tier", tier)):
                    res[f"{side}_put"].append(p)
                    res[f"{side}_get"].append(g)
        writer.stop()
        mtier.close()
        client.close()
        gbs = {k: total / statistics.median(v) / 1e9 for k, v in res.items()}
        # paired per round (raw and tier run back to back), so load from other processes
        # on the machine moves both sides of a ratio together
        paired = {
            p: statistics.median(
                r / t for r, t in zip(res[f"raw_{p}"], res[f"tier_{p}"], strict=True)
            )
            for p in ("put", "get")
        }
        return {
            "pages": n,
            "page_bytes": PAGE,
            "rounds": args.rounds,
            "gbs": gbs,
            "write_ratio": paired["put"],
            "promote_ratio": paired["get"],
        }
    finally:
        node.kill()
        master.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=128, help="2 MiB pages per round (128)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="tier writer threads (2)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        print(orjson.dumps(out).decode())
        return
    g = out["gbs"]
    print(f"{out['pages']} x 2 MiB pages, median of {out['rounds']} rounds")
    print(
        f"write-through  tier {g['tier_put']:6.2f} GB/s   raw batch_put_from  {g['raw_put']:6.2f} GB/s"
        f"   {out['write_ratio']:.2f}x (target >= 0.8x)"
    )
    print(
        f"promotion      tier {g['tier_get']:6.2f} GB/s   raw batch_get_into  {g['raw_get']:6.2f} GB/s"
        f"   {out['promote_ratio']:.2f}x (target >= 0.8x)"
    )


if __name__ == "__main__":
    main()
