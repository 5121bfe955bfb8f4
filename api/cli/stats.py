"""Small statistics the commands report (and the benches in loadtest/ reuse)."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values` (0.0 for none)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0
