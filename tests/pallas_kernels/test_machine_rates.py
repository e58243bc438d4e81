"""`pallas_kernels.machine_rates`: each probe's rate from its bytes or FLOPs over the time the timing rule
(`pallas_kernels.timing`, tested in test_timing.py) reports."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import machine_rates


def test_matmul_rate_is_two_n_cubed_flops_over_the_time_of_the_matmul(monkeypatch):
    timed = []

    def fake_best(fn, *args, iters=1, repeats=3):
        timed.append((fn(*args), repeats, iters))
        return 0.25

    monkeypatch.setattr(machine_rates, "best_seconds_per_call", fake_best)
    assert machine_rates.matmul_rate(n=8, dtype="bfloat16", repeats=4, iters=3) == 2.0 * 8**3 / 0.25
    ((product, repeats, iters),) = timed
    assert product.shape == (8, 8) and product.dtype == jnp.bfloat16 and (repeats, iters) == (4, 3)


def test_memory_bandwidth_reads_the_array_once_and_copies_it(monkeypatch):
    outputs = []
    seconds = iter([0.5, 2.0])  # the reduction, then the copy

    def fake_best(fn, *args, iters=1, repeats=3):
        outputs.append(np.asarray(fn(*args)))
        return next(seconds)

    monkeypatch.setattr(machine_rates, "best_seconds_per_call", fake_best)
    bw = machine_rates.memory_bandwidth(mbytes=1 / 64, repeats=2)
    n = (1 << 20) // 64 // 4  # float32 elements in 1/64 MiB
    read, copy = outputs
    assert read == pytest.approx(n * (n - 1) / 2, rel=1e-6)  # the sum of arange(n): every element read
    assert copy.shape == (n,) and copy[2] == 3.0  # every element scaled and written back
    assert bw == machine_rates.Bandwidth(read_bytes_per_s=4 * n / 0.5, copy_bytes_per_s=2 * 4 * n / 2.0,
                                         array_mbytes=1 / 64)
    assert bw.best == bw.read_bytes_per_s


def test_the_probes_run_for_real_on_tiny_arrays():
    rate = machine_rates.matmul_rate(n=32, repeats=2)
    bw = machine_rates.memory_bandwidth(mbytes=1 / 16, repeats=2, iters=2)
    # Below 1 PFLOP/s and 100 TB/s on any machine this runs on; a wrong unit (ms, not s) would exceed them.
    assert 0 < rate < 1e15 and 0 < bw.read_bytes_per_s < 1e14 and 0 < bw.copy_bytes_per_s < 1e14
