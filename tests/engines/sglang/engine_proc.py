"""One SGLang engine process for the two-process test: SGLang's HybridCacheController over a
KV host pool ("allocator": "shm", zero copy) and a Mamba host pool (inline pages), with the
backend attached through `storage_backend="dynamic"`.

    python -m tests.engines.sglang.engine_proc URL write|read SEED

write: fills 16 tokens' KV pages and one Mamba state, writes them back to storage.
read:  prefetches the same tokens into its own (differently filled) pools.
Prints one JSON line: tokens loaded and digests of the pages moved.
"""

from __future__ import annotations

import hashlib
import json
import sys

from loadtest.kit.sglang import pools as kit

TOKENS = list(range(100, 116))


def digest(host, pages) -> str:
    return hashlib.sha256(b"".join(kit.page_bytes(host, int(p)) for p in pages)).hexdigest()


def main(url: str, op: str, seed: int) -> dict:
    kv, state = kit.mha("page_first", allocator="shm"), kit.mamba()
    kit.randomize(kv[1], seed)
    kit.randomize(state[1], seed + 1)
    cc = kit.hybrid_controller(url, kv, {kit.PoolName.MAMBA: state})
    try:
        if op == "write":
            host_idx, slot = kv[1].alloc(len(TOKENS)), state[1].alloc(1)
            done = kit.write_back(
                cc, host_idx, TOKENS, [kit.mamba_trailing(slot, kit.hashes(TOKENS)[-1])]
            )
            return {
                "tokens": done.completed_tokens,
                "kv": digest(kv[1], host_idx[:: kit.P] // kit.P),
                "mamba": digest(state[1], slot),
                "zero_copy": cc.storage_backend.bindings["kv"].buffer_id is not None,
            }
        probe = kit.mamba_trailing()
        host_idx, loaded, hits = kit.prefetch(cc, TOKENS, [probe])
        return {
            "tokens": loaded,
            "kv": digest(kv[1], host_idx[:: kit.P] // kit.P),
            "mamba": digest(state[1], probe.host_indices),
            "mamba_hits": hits.get("mamba", 0),
        }
    finally:
        cc.detach_storage_backend()


if __name__ == "__main__":
    with kit.single_rank(), kit.host_budget():
        print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
