"""A stand-in engine with GPU KV buffers, registered by CUDA IPC.

    python -m tests.api.cuda_engine_proc URL NAMESPACE set|get|one|hold LAYOUT PAGES
set: random pages 0..PAGES-1 stored from the device; get: all of them loaded into a zeroed
buffer; one: only page 3 loaded, into slot 0 of a zeroed buffer; hold: register and wait.
Prints one JSON line: {"ok": bool, "digest": "...", "pages": [digest of each slot], "buffer_id": "..."}.
"""

import hashlib
import sys
import time

import orjson
import torch

from api.engine.client import SidecarClient
from api.engine.cuda_export import register_cuda

LAYERS, HALF = 4, 64 * 1024  # per-layer K (or V) bytes of one page


def buffers(layout: str, slots: int):
    if layout == "page_first":  # one allocation, K and V runs per page
        kv = torch.empty((2, slots, LAYERS * HALF), dtype=torch.uint8, device="cuda")
        return [kv[0], kv[1]]
    # layer_first as SGLang keeps it: one tensor per layer for K and for V (many allocations)
    return [torch.empty((slots, HALF), dtype=torch.uint8, device="cuda") for _ in range(2 * LAYERS)]


def page_digests(tensors, slots: int) -> list[str]:
    host = [t.cpu().numpy() for t in tensors]
    return [
        hashlib.sha256(b"".join(h[i].tobytes() for h in host)).hexdigest() for i in range(slots)
    ]


def main(url, ns, op, layout, pages):
    client = SidecarClient(url, timeout=60)
    tensors = buffers(layout, pages)
    page_bytes = sum(t[0].numel() for t in tensors)
    client.put_namespace(ns, page_bytes, layout=layout)
    keys = [f"{layout}-{i}" for i in range(pages)]
    if op == "set":
        g = torch.Generator(device="cuda").manual_seed(11)
        for t in tensors:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device="cuda", generator=g))
    else:
        for t in tensors:
            t.zero_()
    torch.cuda.synchronize()  # the sidecar copies on its own streams: the writes must be done
    bid = register_cuda(client, ns, tensors, pages)
    if op == "hold":
        print(orjson.dumps({"buffer_id": bid}).decode(), flush=True)
        time.sleep(600)
        return
    if op == "one":
        ok = all(client.get(ns, keys[3:4], bid, [0]))
    else:
        fn = client.set if op == "set" else client.get
        ok = all(fn(ns, keys, bid, list(range(pages))))
    torch.cuda.synchronize()
    digest = hashlib.sha256(b"".join(t.cpu().numpy().tobytes() for t in tensors)).hexdigest()
    out = {"ok": ok, "digest": digest, "pages": page_digests(tensors, pages), "buffer_id": bid}
    print(orjson.dumps(out).decode(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
