"""One TP rank of a two-rank SGLang engine for the restorable-set test: a gloo process group
of 2 (torch.distributed on the CPU, no GPU), SGLang's `_SwaStrategy` stack (MHA full + SWA
halves, stored per rank) whose HybridCacheController reduces hits over that group, as
SGLang's scheduler ranks do.

    python -m tests.engines.sglang.restorable_proc URL RANK INIT_FILE

Both ranks store 4 KV pages; rank 0 stores the 1-page SWA window at pages {0, 2} (endpoints
{1, 3} restorable), rank 1 at pages {0, 1} (endpoints {1, 2}). Then both prefetch the span in
lockstep. Prints one JSON line: this rank's own restorable endpoints (the backend's answer),
the hit the controller agreed on, tokens loaded, whether the loaded window page is this rank's.
Replaced (GPU-only): cudaHostRegister of the host pools (assembled.unpin).
"""

from __future__ import annotations

import json
import sys

import torch

from loadtest.kit.sglang import pools as kit
from loadtest.kit.sglang.pools import PoolName
from tests.engines.sglang import assembled as asm

P = asm.SMALL_P
TOKENS = list(range(80000, 80000 + 4 * P))
WINDOWS = {0: (0, 2), 1: (0, 1)}  # SWA pages each rank stores


def write(stack, rank: int):
    """KV for the whole span, then one window page per write-back, as the tree writes nodes."""
    kv_idx = stack.group.alloc(len(TOKENS))
    assert asm.write_back(stack, kv_idx, TOKENS).completed_tokens == len(TOKENS)
    swa, where = stack.group.entry_map[PoolName.SWA].host_pool, {}
    keys = asm.hashes(TOKENS, P)
    for page in WINDOWS[rank]:
        win = swa.alloc(P)
        end = (page + 1) * P
        asm.write_back(
            stack,
            kv_idx[:end],
            TOKENS[:end],
            [asm.trailing(PoolName.SWA, win, keys[page : page + 1])],
        )
        where[page] = asm.pages_of(win, P)[0]
    return where


def main(url: str, rank: int, init_file: str) -> dict:
    asm.unpin()
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    with asm.tp_rank(rank, 2):
        stack = asm.swa_stack(url, tp_group=torch.distributed.group.WORLD)
    try:
        asm.fill_all(stack, 40 + rank)
        where = write(stack, rank)
        keys = asm.hashes(TOKENS, P)
        own = stack.cc.storage_backend.batch_exists_v2(
            keys, [asm.trailing(PoolName.SWA, keys=["__placeholder__"])]
        )
        torch.distributed.barrier()  # both ranks wrote before either queries
        stack.group.alloc(P)
        got = asm.prefetch(stack, TOKENS, [asm.trailing(PoolName.SWA, keys=["__placeholder__"])])
        swa = stack.group.entry_map[PoolName.SWA].host_pool
        loaded_win = asm.pages_of(got.comp[0].host_indices, P) if got.loaded else []
        hit_pages = got.op.storage_hit_count // P
        mine = [
            kit.page_bytes(swa, p) == kit.page_bytes(swa, where[hit_pages - 1]) for p in loaded_win
        ]
        return {
            "restorable": own.restorable_prefix_pages,
            "own_hit": own.kv_hit_pages,
            "hit": hit_pages,
            "loaded": got.loaded // P,
            "window_is_mine": mine,
            "failures": stack.cc.storage_backend.failures,
        }
    finally:
        stack.cc.detach_storage_backend()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    with kit.host_budget():
        print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
