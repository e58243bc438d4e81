"""The C++ matmul on packed weights (`pallas_kernels/panel_matmul_cpu.py`) against its float64 numpy reference,
and the packing.

The kernel must be built (`pip install -e .` builds it); these tests fail, never skip, where it is not. Shapes
cover every code path: rows below, at and past a register block (6 on AVX-512, 1 otherwise) and its tails, at
and past the few-row split (32 rows: several panels a unit); columns within one panel, at whole panels and past
them (the last panel partial); K of any size, 1 included.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.panel_matmul_cpu import (
    PANEL, cpu_matmul_status, pack_panels, panel_matmul_cpu, panel_matmul_reference, unpack_panels,
)

# The module (the package's attribute of that name could be shadowed by a function one day: import it by name).
kernel_module = importlib.import_module("pallas_kernels.panel_matmul_cpu")
panel_matmul_jit = jax.jit(panel_matmul_cpu, static_argnums=2)

# float32 sums of K products of N(0, 1) values: the error grows like sqrt(K) * eps * |x| |w|.
RTOL, ATOL = 1e-5, 2e-5


def test_kernel_is_built():
    assert cpu_matmul_status() is None, cpu_matmul_status()
    assert kernel_module.vector_bits() in (256, 512)


def test_packing_round_trips_and_pads_with_zeros():
    w = np.arange(2 * 70 * 3, dtype=np.float32).reshape(2, 70, 3)  # stacked layers [2, N=70, K=3]
    panels = np.asarray(pack_panels(w))
    assert panels.shape == (2, 2, 3, PANEL)
    assert panels[1, 0, 2, 5] == w[1, 5, 2] and panels[0, 1, 1, 5] == w[0, PANEL + 5, 1]
    assert not panels[:, 1, :, 70 - PANEL:].any()  # rows past N
    np.testing.assert_array_equal(np.asarray(unpack_panels(panels, 70)), w)


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 32, 33, 100])
@pytest.mark.parametrize("k,n", [(512, 1536), (64, 4), (80, 130), (7, 64), (576, 129), (1, 3)])
def test_matches_the_float64_reference(m, k, n):
    rng = np.random.default_rng(m * 1000 + k * 7 + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((n, k), np.float32)
    got = np.asarray(panel_matmul_jit(x, pack_panels(w), n))
    want = panel_matmul_reference(x, w)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.sqrt(k))


def test_non_finite_inputs_reach_only_their_outputs():
    x = np.ones((9, 48), np.float32)
    w = np.ones((70, 48), np.float32)
    x[2, 40] = np.nan  # row 2 only
    w[67, 3] = np.inf  # column 67 only (in the partial panel)
    got = np.asarray(panel_matmul_cpu(x, pack_panels(w), 70))
    want = panel_matmul_reference(x, w)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=RTOL)
    assert finite.sum() == 9 * 70 - 70 - 9 + 1  # row 2 and column 67 (row 2 of column 67 counted once)


def test_empty_sides():
    got = np.asarray(panel_matmul_cpu(np.ones((3, 0), np.float32), pack_panels(np.ones((5, 0), np.float32)), 5))
    assert got.tolist() == np.zeros((3, 5)).tolist()
    assert panel_matmul_cpu(np.ones((0, 8), np.float32), pack_panels(np.ones((5, 8), np.float32)), 5).shape == (0, 5)


def test_rejects_bad_shapes_and_dtypes():
    panels = pack_panels(np.ones((70, 3), np.float32))  # [2, 3, 64]
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        panel_matmul_cpu(np.ones((2, 4), np.float32), panels, 70)  # K differs
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        panel_matmul_cpu(np.ones((2, 3), np.float32), panels, 200)  # n needs 4 panels
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        panel_matmul_cpu(np.ones((2, 3, 1), np.float32), panels, 70)
    with pytest.raises(ValueError, match="float32"):
        panel_matmul_cpu(jnp.ones((2, 3), jnp.bfloat16), panels.astype(jnp.bfloat16), 70)


def test_vmap_and_a_jitted_caller():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 40), np.float32)
    w = rng.standard_normal((24, 40), np.float32)
    got = np.asarray(jax.jit(jax.vmap(lambda x, p: panel_matmul_cpu(x, p, 24), in_axes=(0, None)))(x, pack_panels(w)))
    for i in range(3):
        np.testing.assert_allclose(got[i], panel_matmul_reference(x[i], w), rtol=RTOL, atol=ATOL * np.sqrt(40))


def test_the_engine_uses_the_kernel_only_on_avx512_builds(monkeypatch):
    assert kernel_module.engine_uses_kernel() == (kernel_module.vector_bits() == 512)
    monkeypatch.setattr(kernel_module, "vector_bits", lambda: 256)
    assert not kernel_module.engine_uses_kernel()
