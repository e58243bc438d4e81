"""sarathi_jax/models/layers.py: `materialized` returns its input's values exactly, as an op of its own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sarathi_jax.models.layers import materialized


def test_materialized_keeps_every_normal_value():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal((64, 32)) * 10.0 ** rng.integers(-30, 30, (64, 32)),
                        np.cos(rng.uniform(0, 1e5, (64, 32))), np.sin(np.arange(64 * 32).reshape(64, 32)),
                        np.zeros((1, 32))]).astype(np.float32)  # across the exponent range, RoPE-like, zeros
    got = np.asarray(jax.jit(materialized)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, x)
    # A subnormal flushes to zero (the matmul runs with denormals off); no cos or sin of a RoPE angle is one.
    tiny = np.full((2, 8), 1e-40, np.float32)
    assert np.all(np.asarray(jax.jit(materialized)(jnp.asarray(tiny))) == 0.0)


def test_materialized_is_computed_once_for_all_its_readers():
    # The cos of a [T, N] array read by two consumers broadcast over heads: with `materialized` the optimized
    # module evaluates the cosine over T x N elements once, in a fusion of its own, whatever reads it.
    def f(a, x1, x2):
        c = materialized(jnp.cos(a))
        return x1 * c[:, None, :], x2 * c[:, None, :]

    a = jnp.zeros((16, 8), jnp.float32)
    x = jnp.zeros((16, 4, 8), jnp.float32)
    hlo = jax.jit(f).lower(a, x, x).compile().as_text()
    cosines = [line for line in hlo.splitlines() if " cosine(" in line]
    assert len(cosines) == 1 and "f32[16,8]" in cosines[0]
