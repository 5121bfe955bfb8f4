"""A stand-in SGLang engine for the linker's device path (api.engine.sglang_linker_cuda), on a
GPU and without SGLang: an MHA pool laid out as SGLang's MHATokenToKVPool keeps it (a K and a
V tensor per layer, rows = tokens, one page = PAGE tokens, a spare page at the end), read
through the linker's own `page_views` / `direct_pool` / `gate`.

    python -m tests.engines.adapters.linker_cuda_proc URL NAMESPACE offload|offload-ungated|load
offload: the "forward pass" writes pages 2, 5, 7 on a side stream behind a ~2 s GPU sleep and
records an event; the offload thread gates on it and stores them (two rounds: 2, then 5 and 7).
load: pages stored as 2, 5, 7 loaded into pages 0, 3, 4 of a zeroed pool.
Prints one JSON line: digests of the pages, the answers, the pool's buffers in the sidecar.
"""

import hashlib
import sys
import threading

import orjson
import torch

from api.engine.client import SidecarClient
from api.engine.sglang_linker_cuda import direct_pool, gate, page_views

LAYERS, TOKENS, HEADS, DIM, PAGE = 4, 8 * 16 + 16, 2, 64, 16
STORED, LOADED = [2, 5, 7], [0, 3, 4]


def pool() -> list[torch.Tensor]:
    shape = (TOKENS, HEADS, DIM)
    return [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2 * LAYERS)]


def digests(views, pages) -> list[str]:
    return [
        hashlib.sha256(b"".join(v[p].cpu().numpy().tobytes() for v in views)).hexdigest()
        for p in pages
    ]


def offload(client, dev, views, gated: bool) -> dict:
    side = torch.cuda.Stream()
    g = torch.Generator(device="cuda").manual_seed(5)
    data = [
        torch.randint(
            -100, 100, (len(STORED), v.shape[1] // 2), dtype=torch.int16, device="cuda", generator=g
        )
        for v in views
    ]
    torch.cuda.synchronize()
    with torch.cuda.stream(side):  # the forward pass: late writes of the pages to offload
        torch.cuda._sleep(4_000_000_000)  # ~2 s of GPU time (at 2 GHz) before the writes land
        for v, d in zip(views, data, strict=True):
            v[STORED] = d.view(torch.uint8)
        ready = torch.cuda.Event()
        ready.record(side)
    keys = [f"k{p}" for p in STORED]
    out: dict = {}

    def offload_thread():  # as the linker's: gate on the events, then the sidecar copies
        if gated:
            gate([ready])
        out["round1"] = client.batch_set([dev.item(keys[:1], [STORED[0] * PAGE])])
        out["round2"] = client.batch_set([dev.item(keys[1:], [p * PAGE for p in STORED[1:]])])

    t = threading.Thread(target=offload_thread)
    t.start()
    t.join()
    torch.cuda.synchronize()
    return out


def main(url: str, ns: str, op: str) -> None:
    client = SidecarClient(url, timeout=60)
    buffers = pool()
    views = page_views(buffers, PAGE)
    page_bytes = sum(v.shape[1] for v in views)
    client.put_namespace(ns, page_bytes)
    dev = direct_pool(ns, views, PAGE, buffers)
    assert dev is not None, "a CUDA pool of 16 KiB pages must go direct"
    first = dev.register(client)
    assert dev.register(client) == first  # registered once per pool
    out: dict = {"slots": dev.slots, "page_bytes": page_bytes}
    if op.startswith("offload"):
        out.update(offload(client, dev, views, gated=op == "offload"))
        out["stored"] = out.pop("round1")[ns] + out.pop("round2")[ns]
        out["pages"] = digests(views, STORED)
    else:
        loaded = client.batch_get([dev.item([f"k{p}" for p in STORED], [p * PAGE for p in LOADED])])
        torch.cuda.synchronize()
        out["loaded"] = loaded[ns]
        out["pages"] = digests(views, LOADED)
        out["untouched_zero"] = all(
            not v[p].any().item() for v in views for p in range(dev.slots) if p not in LOADED
        )
    out["buffers"] = client.stats()["namespaces"][ns]["buffers"]
    dev.release(client)
    print(orjson.dumps(out).decode(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
