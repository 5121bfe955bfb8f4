"""One SGLang engine process for the two-process DSA test: SGLang's `_DsaStrategy` builds the
KV (MLATokenToKVPoolHost) and DSA indexer (DSAIndexerPoolHost) host pools with one packed MTP
draft layer each, and its HybridCacheController attaches the backend (storage_backend="dynamic").

    python -m tests.engines.sglang.assembled_proc URL write|read SEED

write: fills every host pool, writes 4 pages back to storage (KV + the indexer riding on
       the KV indices, as the tree's sidecar spec says).
read:  prefetches the same tokens into its own, differently filled pools.
Prints one JSON line: tokens moved, the slots used and digests of the pages moved per pool.
Replaced (GPU-only): cudaHostRegister of the host pools (assembled.unpin).
"""

from __future__ import annotations

import hashlib
import json
import sys

from loadtest.kit.sglang import pools as kit
from tests.engines.sglang import assembled as asm

TOKENS = list(range(7000, 7000 + 4 * asm.DSA_P))


def digests(stack, host_indices) -> dict:
    pages = asm.pages_of(host_indices, asm.DSA_P)
    return {
        str(e.name): hashlib.sha256(
            b"".join(kit.page_bytes(e.host_pool, p) for p in pages)
        ).hexdigest()
        for e in stack.group.entries
    }


def main(url: str, op: str, seed: int) -> dict:
    asm.unpin()
    stack = asm.dsa_stack(url, drafts=1)
    asm.fill_all(stack, seed)
    backend = stack.cc.storage_backend
    try:
        if op == "write":
            host_idx = stack.group.alloc(len(TOKENS))
            done = asm.write_back(stack, host_idx, TOKENS)
            return {
                "tokens": done.completed_tokens,
                "pages": asm.pages_of(host_idx, asm.DSA_P),
                "zero_copy": sorted(n for n, b in backend.bindings.items() if b.buffer_id),
                "digests": digests(stack, host_idx),
                "failures": backend.failures,
            }
        stack.group.alloc(2 * asm.DSA_P)  # this engine's prefetch lands in other slots
        got = asm.prefetch(stack, TOKENS)
        return {
            "tokens": got.loaded,
            "pages": asm.pages_of(got.host_indices, asm.DSA_P),
            "hit": got.op.storage_hit_count,
            "digests": digests(stack, got.host_indices),
            "failures": backend.failures,
        }
    finally:
        stack.cc.detach_storage_backend()


if __name__ == "__main__":
    with kit.single_rank(), kit.host_budget():
        print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
