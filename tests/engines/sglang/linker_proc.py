"""One SGLang engine process with the kv-sidecar linker, for the multi-process tests (the tree,
pools and steps of loadtest/kit/sglang/linker.py).

    python -m tests.engines.sglang.linker_proc URL share KIND SEED
        computes its own prompt (pages 6, tokens from SEED * 1000), prints {"wrote": digests};
        then reads one line from stdin, the other engine's SEED, loads that prompt and
        prints {"hit": tokens, "failed": n, "loaded": digests}.
    python -m tests.engines.sglang.linker_proc URL tp RANK INIT_FILE
        TP rank RANK of 2 (a gloo process group, as SGLang's scheduler ranks hold one): an MHA
        engine and an MLA engine each compute the same 5-page prompt with this rank's bytes;
        rank 1 then drops page 3 of its MHA namespace; both ranks load; prints one JSON line.

Digests are sha256 of the bytes moved (KV of every layer; and the Mamba state for "mamba").
"""

from __future__ import annotations

import json
import sys

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName

from loadtest.kit.sglang import linker as lk
from loadtest.kit.sglang import pools as kit

PAGES = 6


def digests(eng, slots, req=None) -> dict:
    out = {"kv": lk.digest(lk.kv_buffers(eng), slots)}
    if req is not None and "mamba" in eng.kind:
        out["mamba"] = lk.digest(lk.mamba_buffers(eng), [req.kv.mamba_pool_idx])
    return out


def share(url: str, kind: str, seed: int) -> None:
    with kit.single_rank(), kit.host_budget():
        eng = lk.engine(url, kind)
        lk.scramble(eng, seed + 50)
        try:
            tokens = lk.tokens_of(seed * 1000, PAGES)
            req, slots = lk.compute(eng, tokens, seed)
            lk.settle(eng)
            wrote = digests(eng, slots)
            if "mamba" in kind:
                wrote["mamba"] = lk.digest(lk.mamba_buffers(eng), [lk.mamba_slot(eng, tokens)])
            print(
                json.dumps({"wrote": wrote, "offloaded": eng.linker.stats["pages_offloaded"]}),
                flush=True,
            )
            other = int(sys.stdin.readline())
            req, m = lk.match(eng, lk.tokens_of(other * 1000, PAGES))
            got = lk.load(eng, req)
            print(
                json.dumps(
                    {
                        "hit": got.tokens,
                        "failed": len(got.failed),
                        "loaded": digests(eng, got.slots, req),
                    }
                ),
                flush=True,
            )
        finally:
            eng.close()


def tp(url: str, rank: int, init_file: str) -> dict:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    group = torch.distributed.group.WORLD
    override = kit.get_parallel().override(
        tp_rank=rank,
        tp_size=2,
        attn_tp_rank=rank,
        attn_tp_size=2,
        moe_tp_size=2,
        moe_tp_rank=rank,
        pp_rank=0,
        pp_size=1,
        attn_dcp_size=1,
        attn_dcp_rank=0,
    )
    out = {}
    with override, kit.host_budget():
        engines = {
            kind: lk.engine(url, kind, tp_group=group, tp=(rank, 2)) for kind in ("kv", "mla")
        }
        try:
            tokens, written = lk.tokens_of(7000, 5), {}
            for kind, eng in engines.items():
                lk.scramble(eng, 10 * rank + len(kind))
                req, slots = written[kind] = lk.compute(eng, tokens, seed=rank * 10 + len(kind))
                lk.settle(eng)
                out[kind] = {
                    "wrote": lk.digest(lk.kv_buffers(eng), slots),
                    "offloaded": eng.linker.stats["pages_offloaded"],
                    "namespace": eng.linker.names[PoolName.KV],
                }
            torch.distributed.barrier()
            if rank == 1:
                mha = engines["kv"].linker
                mha.client.delete(mha.names[PoolName.KV], [kit.hashes(tokens)[3]])
            torch.distributed.barrier()
            for kind in ("kv", "mla"):
                fresh = lk.engine(url, kind, tp_group=group, tp=(rank, 2))
                lk.scramble(fresh, 99 + rank)
                answers = []
                real = fresh.linker.lookup
                fresh.linker.lookup = lambda rid, t, answers=answers, real=real: (
                    answers.append(real(rid, t)) or answers[-1]
                )
                req, m = lk.match(fresh, tokens)
                got = lk.load(fresh, req)
                prefix = written[kind][1][: got.tokens]
                out[kind].update(
                    own=answers[-1],
                    hit=m.host_hit_length // lk.P,
                    failed=len(got.failed),
                    loaded=lk.digest(lk.kv_buffers(fresh), got.slots),
                    wrote_prefix=lk.digest(lk.kv_buffers(engines[kind]), prefix),
                )
                fresh.close()
        finally:
            for eng in engines.values():
                eng.close()
            torch.distributed.destroy_process_group()
    return out


if __name__ == "__main__":
    if sys.argv[2] == "share":
        share(sys.argv[1], sys.argv[3], int(sys.argv[4]))
    else:
        print(json.dumps(tp(sys.argv[1], int(sys.argv[3]), sys.argv[4])), flush=True)
