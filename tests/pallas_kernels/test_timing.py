"""`pallas_kernels.timing`: the timing rule (warm-up, best of repeats, back-to-back calls synchronised once) on
a fake clock."""

from __future__ import annotations

import itertools

import jax.numpy as jnp

from pallas_kernels import timing


def counting_fn():
    calls = itertools.count()

    def fn(x):
        next(calls)
        return x + 1

    return fn, calls


def test_seconds_per_call_times_iters_calls_together(monkeypatch):
    ticks = iter([10.0, 16.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    fn, calls = counting_fn()
    assert timing.seconds_per_call(fn, jnp.zeros(()), iters=3) == 2.0
    assert next(calls) == 3


def test_best_seconds_per_call_warms_up_then_keeps_the_fastest_run_per_call(monkeypatch):
    # Runs of 2 calls each take 6, 2 and 4 s on the fake clock: the best is 2 s, so 1 s per call.
    ticks = iter([0.0, 6.0, 10.0, 12.0, 20.0, 24.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    fn, calls = counting_fn()
    assert timing.best_seconds_per_call(fn, jnp.zeros(()), repeats=3, iters=2) == 1.0
    assert next(calls) == 1 + 3 * 2  # one warm-up call, then 3 runs of 2


def test_best_seconds_per_call_without_warm_up(monkeypatch):
    ticks = iter([0.0, 5.0, 5.0, 8.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    fn, calls = counting_fn()
    assert timing.best_seconds_per_call(fn, jnp.zeros(()), repeats=2, warmup=0) == 3.0
    assert next(calls) == 2
