"""`restorable_prefix_pages` as SGLang intersects it across TP ranks: two engine processes, one
TP rank each in a gloo process group, SGLang's HybridCacheController reducing the hit over it
(`_sync_prefetch_hit_query`: one restorable flag per endpoint, MIN across ranks). The ranks
hold different SWA windows, so each rank's own best endpoint is illegal on the other."""

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_two_ranks_with_different_windows_agree_on_the_intersection(spawn, tmp_path):
    sidecar = spawn("--host-pool", "32MiB", "--no-file-tier").wait_ready()
    init = tmp_path / "gloo-init"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.engines.sglang.restorable_proc",
                sidecar.socket_url,
                str(rank),
                str(init),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
        for rank in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    r0, r1 = outs
    assert r0["restorable"] == [1, 3] and r1["restorable"] == [1, 2]  # each rank's own answer
    assert (r0["own_hit"], r1["own_hit"]) == (3, 2)
    assert (
        min(r0["own_hit"], r1["own_hit"]) not in r0["restorable"]
    )  # MIN of bests: illegal on rank 0
    assert r0["hit"] == r1["hit"] == 1 == max(set(r0["restorable"]) & set(r1["restorable"]))
    assert r0["loaded"] == r1["loaded"] == 1
    assert r0["window_is_mine"] == r1["window_is_mine"] == [True]  # each rank loads its own window
    assert r0["failures"] == r1["failures"] == 0
