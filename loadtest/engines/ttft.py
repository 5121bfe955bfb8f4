"""Time to first token of a long prompt with and without a sidecar hit (`make bench-vllm`).

    python -m loadtest.engines.ttft [--tokens 2000] [--rounds 3]

A "small" random Llama (8 layers, hidden 512) on the vLLM CPU engine. Each round takes a
new prompt: the first run is a miss (computed, then saved), the second, after vLLM's own
prefix cache is emptied, loads every block but the last from the sidecar. Prints medians
and their ratio; both runs go through the same engine, connector and sidecar.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile

from loadtest.kit.procs import start_sidecar
from loadtest.kit.vllm.engine import Engine
from loadtest.kit.vllm.tiny_model import build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build(f"{tmp}/model", size="small")
        sidecar = start_sidecar("--data-dir", f"{tmp}/data", "--host-pool", "512MiB")
        engine = Engine(
            model,
            sidecar.socket_url,
            ENGINE_MAX_MODEL_LEN=str(args.tokens + 64),
            ENGINE_KV_BYTES=str(512 << 20),
        )
        try:
            r = random.Random(3)
            miss, hit, cached = [], [], []
            for _ in range(args.rounds + 1):  # the first round warms the engine up
                prompt = [r.randrange(2, 1024) for _ in range(args.tokens)]
                miss.append(engine.ask(op="ttft", prompt=prompt)["seconds"])
                got = engine.ask(op="ttft", prompt=prompt)
                hit.append(got["seconds"])
                cached.append(got["cached"])
            m, h = statistics.median(miss[1:]), statistics.median(hit[1:])
            print(
                f"prompt {args.tokens} tokens, {args.rounds} rounds: TTFT miss {m * 1e3:.0f} ms, "
                f"hit {h * 1e3:.0f} ms ({min(cached[1:])} tokens loaded), miss/hit {m / h:.1f}x"
            )
            print(
                f"miss runs {[round(x, 3) for x in miss[1:]]}, hit runs {[round(x, 3) for x in hit[1:]]}"
            )
        finally:
            engine.close()
            sidecar.stop()


if __name__ == "__main__":
    main()
