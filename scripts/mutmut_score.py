"""mutmut's score per package (pools, sidecar, api) from `mutmut results --all true`.

    killed + timeout       caught
    survived               the tests passed with the mutant in place
    no tests               no test reached the mutated function (in-process: tests that
                           drive a sidecar subprocess are not counted by mutmut)
score = caught / (caught + survived + no tests); not checked / skipped are left out.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys

MUTMUT = os.path.join(os.path.dirname(sys.executable), "mutmut")


def main() -> int:
    out = subprocess.run(
        [MUTMUT, "results", "--all", "true"], capture_output=True, text=True
    ).stdout
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            counts[name.split(".")[0]][status.strip()] += 1
    print(f"{'package':<10}{'caught':>8}{'survived':>10}{'no tests':>10}{'other':>8}{'score':>9}")
    for pkg, c in sorted(counts.items()):
        caught = c["killed"] + c["timeout"]
        tested = caught + c["survived"] + c["no tests"]
        other = sum(c.values()) - tested
        score = f"{100.0 * caught / tested:.1f}%" if tested else "not run"
        print(f"{pkg:<10}{caught:>8}{c['survived']:>10}{c['no tests']:>10}{other:>8}{score:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
