"""`python -m sidecar serve` whose file tier takes KV_SIDECAR_TEST_READ_DELAY_MS longer to
read each page: a slowed tier, a fault injected on purpose (issue 44's "never slower than
recomputing"). Tests and benches only.

    python -m loadtest.kit.vllm.slow_tier serve --port ... --data-dir ...
"""

from __future__ import annotations

import os
import sys
import time

from sidecar.cli import main
from sidecar.tiers.file_tier import FileTier


def slow_reads(delay_s: float) -> None:
    """Every FileTier page read sleeps `delay_s` first."""
    real = FileTier.read

    def read(self, identity: str, key: str, dst) -> bool:
        time.sleep(delay_s)
        return real(self, identity, key, dst)

    FileTier.read = read


if __name__ == "__main__":
    slow_reads(float(os.environ.get("KV_SIDECAR_TEST_READ_DELAY_MS", "0")) / 1e3)
    sys.exit(main())
