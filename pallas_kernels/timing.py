"""Wall-clock timing of jitted calls, for every benchmark (the tuner here, the step timer in `sarathi_jax.bench`,
the kernel benches and machine probes in `benchmarks/`): a leaf module, so that all of them can import it.

JAX dispatches asynchronously: a call returns before the device is done, so a timed run ends with
`jax.block_until_ready` on the last output. Calls back to back are synchronised once, at the end, so that host
dispatch overlaps device work as it does in a serving loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax


def seconds_per_call(fn: Callable[..., Any], *args: Any, iters: int = 1) -> float:
    """Wall seconds per call of `iters` back-to-back calls `fn(*args)`, synchronised once on the last output."""
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def best_seconds_per_call(fn: Callable[..., Any], *args: Any, iters: int = 1, repeats: int = 3,
                          warmup: int = 1) -> float:
    """The best of `repeats` runs of `seconds_per_call`, after `warmup` synchronised calls (they compile): the
    run least disturbed by other processes."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return min(seconds_per_call(fn, *args, iters=iters) for _ in range(repeats))
