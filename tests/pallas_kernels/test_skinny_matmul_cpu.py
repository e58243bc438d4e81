"""The C++ few-row matmul (`pallas_kernels/skinny_matmul_cpu.py`) against its float64 numpy reference, and the
engine's out-major projections with and without it.

The kernel must be built (`pip install -e .` builds it); these tests fail, never skip, where it is not. Shapes
cover every code path: rows below, at and past a register block (4 on AVX-512, 2 otherwise) and its tails;
weight rows past a register block (4) and a work unit (64) with their tails; K a multiple of 16 or not (the
scalar tail), and K below 16 (no vector step at all).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.skinny_matmul_cpu import cpu_matmul_status, skinny_matmul_cpu, skinny_matmul_reference

# The module (the package exports a function of the same name).
kernel_module = importlib.import_module("pallas_kernels.skinny_matmul_cpu")

# float32 sums of K products of N(0, 1) values: the error grows like sqrt(K) * eps * |x| |w|.
RTOL, ATOL = 1e-5, 2e-5


def test_kernel_is_built():
    assert cpu_matmul_status() is None, cpu_matmul_status()
    assert kernel_module.vector_bits() in (256, 512)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 32, 33])
@pytest.mark.parametrize("k,n", [(512, 1536), (64, 4), (80, 67), (7, 130), (576, 129), (1, 3)])
def test_matches_the_float64_reference(m, k, n):
    rng = np.random.default_rng(m * 1000 + k * 7 + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((n, k), np.float32)
    got = np.asarray(jax.jit(skinny_matmul_cpu)(x, w))
    want = skinny_matmul_reference(x, w)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.sqrt(k))


def test_non_finite_inputs_reach_only_their_outputs():
    x = np.ones((5, 48), np.float32)
    w = np.ones((9, 48), np.float32)
    x[2, 40] = np.nan  # row 2 only
    w[7, 3] = np.inf   # column 7 only
    got = np.asarray(skinny_matmul_cpu(x, w))
    want = skinny_matmul_reference(x, w)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=RTOL)
    assert finite.sum() == 5 * 9 - 9 - 4  # row 2 and column 7 (row 2 of column 7 counted once)


def test_empty_sides():
    assert np.asarray(skinny_matmul_cpu(np.ones((3, 0), np.float32), np.ones((5, 0), np.float32))).tolist() == (
        np.zeros((3, 5)).tolist())
    assert skinny_matmul_cpu(np.ones((0, 8), np.float32), np.ones((5, 8), np.float32)).shape == (0, 5)


def test_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        skinny_matmul_cpu(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32))
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        skinny_matmul_cpu(np.ones((2, 3, 1), np.float32), np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match="float32"):
        skinny_matmul_cpu(jnp.ones((2, 3), jnp.bfloat16), jnp.ones((4, 3), jnp.bfloat16))


def test_vmap_and_a_jitted_caller():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 40), np.float32)
    w = rng.standard_normal((24, 40), np.float32)
    got = np.asarray(jax.jit(jax.vmap(skinny_matmul_cpu, in_axes=(0, None)))(x, w))
    for i in range(3):
        np.testing.assert_allclose(got[i], skinny_matmul_reference(x[i], w), rtol=RTOL, atol=ATOL * np.sqrt(40))


@pytest.mark.parametrize("rows", [1, 24, 32, 33, 64])
@pytest.mark.parametrize("num_contracting", [1, 2])
def test_out_major_product_with_and_without_the_kernel(monkeypatch, rows, num_contracting):
    """The engine's projection (`models/out_major.out_major_product`) takes the kernel for float32 steps of at
    most MAX_ROWS rows where the engine uses it, XLA's dot otherwise: the same values (to float32 rounding) as
    the float64 tensordot either way, and the traced step calls the kernel exactly where it should."""
    from sarathi_jax.models import out_major

    rng = np.random.default_rng(rows + num_contracting)
    in_shape = (4, 16) if num_contracting == 2 else (64,)
    x = rng.standard_normal((rows, *in_shape), np.float32)
    kernel = rng.standard_normal((3, 10, *in_shape), np.float32)  # out-major [out..., in...]
    want = np.tensordot(x.astype(np.float64), kernel.astype(np.float64),
                        axes=(list(range(1, 1 + num_contracting)), list(range(2, 2 + num_contracting))))
    uses = kernel_module.engine_uses_kernel()
    for enabled in (True, False):
        monkeypatch.setattr(out_major, "engine_uses_kernel", lambda enabled=enabled: enabled and uses)
        fn = jax.jit(lambda x, w: out_major.out_major_product(x, w, num_contracting, jax.lax.Precision.HIGHEST))
        got = np.asarray(fn(x, kernel))
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * 8)
        calls = "sarathi_skinny_matmul" in fn.lower(x, kernel).as_text()
        assert calls == (enabled and uses and rows <= kernel_module.MAX_ROWS), (enabled, rows)


def test_the_engine_uses_the_kernel_only_on_avx512_builds():
    assert kernel_module.engine_uses_kernel() == (kernel_module.vector_bits() == 512)
