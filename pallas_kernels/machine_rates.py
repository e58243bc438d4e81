"""This machine's rates, the denominators of every floor: a jitted matmul's FLOP/s and memory bandwidth.

The one probe for the kernel benchmark (`benchmarks.kernels`), the roofline of an engine step
(`sarathi_jax.bench.roofline`) and the sampler benchmark (`benchmarks.probes.sampler_cost`). It
lives here, in the lowest package, because `sarathi_jax` imports `pallas_kernels` and never the other way round.

Each rate is the best of `repeats` timed runs (on a shared machine the best run is the least disturbed one, so
a floor stays a lower bound). A run is `iters` calls back to back, synchronised once at the end, so that host
dispatch overlaps device work (`iters=1` times one synchronised call): `timing.best_seconds_per_call`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.timing import best_seconds_per_call


def matmul_rate(n: int = 2048, dtype: str = "float32", repeats: int = 5, iters: int = 1) -> float:
    """FLOP/s of a jitted n x n x n matmul in `dtype` (2 n^3 FLOPs per call)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(k1, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(k2, (n, n), jnp.float32).astype(dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    return 2.0 * n**3 / best_seconds_per_call(matmul, a, b, iters=iters, repeats=repeats)


@dataclass(frozen=True)
class Bandwidth:
    """Bytes/s of a jitted float32 reduction (reads the array once) and of a scaled copy (reads and writes it)."""

    read_bytes_per_s: float
    copy_bytes_per_s: float
    array_mbytes: float

    @property
    def best(self) -> float:
        return max(self.read_bytes_per_s, self.copy_bytes_per_s)


def memory_bandwidth(mbytes: float = 256, repeats: int = 5, iters: int = 1) -> Bandwidth:
    """The read and the copy bandwidth over an array of `mbytes` MiB."""
    n = int(mbytes * (1 << 20)) // 4
    x = jnp.arange(n, dtype=jnp.float32)
    read = jax.jit(jnp.sum)
    copy = jax.jit(lambda v: v * 1.5)
    nbytes = 4.0 * n
    return Bandwidth(read_bytes_per_s=nbytes / best_seconds_per_call(read, x, iters=iters, repeats=repeats),
                     copy_bytes_per_s=2 * nbytes / best_seconds_per_call(copy, x, iters=iters, repeats=repeats),
                     array_mbytes=mbytes)
