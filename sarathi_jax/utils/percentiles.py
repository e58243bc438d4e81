"""Percentiles of latency samples, the one definition the simulator and the bench share (numpy only).

Percentiles use numpy's default: linear interpolation between closest ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile of `values` (numpy's default: linear interpolation between closest ranks); nan when
    there are none."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def percentiles(values: Iterable[float | None], qs: Sequence[float] = (50, 90, 99)) -> dict:
    """{"p50": .., "p90": .., "p99": .., "max": .., "mean": .., "count": n} over the values that are not None;
    None for each statistic when there are none."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    out: dict = {}
    for q in qs:
        out[f"p{q:g}"] = percentile(v, q) if v.size else None
    out["max"] = float(v.max()) if v.size else None
    out["mean"] = float(v.mean()) if v.size else None
    out["count"] = int(v.size)
    return out
