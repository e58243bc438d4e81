"""The C++ int8-weight matmul on packed weights (`panel_matmul_int8_cpu` in `pallas_kernels/panel_matmul_cpu.py`)
against its float64 numpy reference, and int8 packing.

The kernel must be built (`pip install -e .` builds it); these tests fail, never skip, where it is not. Shapes
cover every code path: rows below, at and past the register block (6 rows; on AVX2 1-2 rows x 4 vectors, 3-6
rows x 2) and its tails, at and past the few-row split (32 rows: several panels a unit), many rows; columns
within one panel, at whole panels and past them (the last panel partial); K of any size, 1 and odd included.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.panel_matmul_cpu import (
    PANEL, int8_matmul_status, pack_panels, panel_matmul_int8_cpu, panel_matmul_int8_reference, unpack_panels,
)

# The module (the package's attribute of that name could be shadowed by a function one day: import it by name).
kernel_module = importlib.import_module("pallas_kernels.panel_matmul_cpu")
panel_matmul_int8_jit = jax.jit(panel_matmul_int8_cpu, static_argnums=3)

# float32 sums of K products of N(0, 1) values (a quantized N(0, 1) weight): the error grows like
# sqrt(K) * eps * |x| |w|, as in the float32 kernel's tests.
RTOL, ATOL = 1e-5, 2e-5


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`w [..., N, K]` -> (q int8, scale float32 [..., N]): scale = max_k |w| / 127, q = round-half-even(w / scale)."""
    scale = np.abs(w).max(axis=-1) / 127
    q = np.round(w / np.where(scale == 0, 1, scale)[..., None]).astype(np.int8)
    return q, scale.astype(np.float32)


def test_kernel_is_built():
    assert int8_matmul_status() is None, int8_matmul_status()
    assert kernel_module.engine_uses_int8_kernel()


def test_int8_packing_round_trips_and_pads_with_zeros():
    q = np.arange(2 * 70 * 3).reshape(2, 70, 3).astype(np.int8)  # stacked layers [2, N=70, K=3], wrapping
    panels = np.asarray(pack_panels(q))
    assert panels.shape == (2, 2, 3, PANEL) and panels.dtype == np.int8
    assert panels[1, 0, 2, 5] == q[1, 5, 2] and panels[0, 1, 1, 5] == q[0, PANEL + 5, 1]
    assert not panels[:, 1, :, 70 - PANEL:].any()  # rows past N
    np.testing.assert_array_equal(np.asarray(unpack_panels(panels, 70)), q)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13, 32, 33, 100, 301])
@pytest.mark.parametrize("k,n", [(512, 1536), (64, 4), (80, 130), (7, 64), (576, 129), (1, 3), (33, 200)])
def test_matches_the_float64_reference(m, k, n):
    rng = np.random.default_rng(m * 1000 + k * 7 + n)
    x = rng.standard_normal((m, k), np.float32)
    q, scale = quantize(rng.standard_normal((n, k), np.float32))
    got = np.asarray(panel_matmul_int8_jit(x, pack_panels(q), scale, n))
    want = panel_matmul_int8_reference(x, q, scale)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.sqrt(k))


def test_int8_extremes_and_a_zero_scale_are_exact():
    # Integer x and weights of -127, 127 and 0: every product and sum is an integer float32 holds exactly.
    m, k, n = 8, 37, 70
    x = np.arange(m * k, dtype=np.float32).reshape(m, k) % 7 - 3
    q = np.zeros((n, k), np.int8)
    q[0::3] = 127
    q[1::3] = -127
    q[5, ::2] = -127  # a row of both extremes
    scale = np.full(n, 0.5, np.float32)
    scale[4] = 0.0  # a zero scale: its column is 0
    scale[69] = 2.0  # the partial panel's last column
    got = np.asarray(panel_matmul_int8_jit(x, pack_panels(q), scale, n))
    want = panel_matmul_int8_reference(x, q, scale)
    np.testing.assert_array_equal(got, want)
    assert not got[:, 4].any() and not got[:, 2].any() and got[:, 0].any()


def test_stacked_layers_pack_and_slice():
    rng = np.random.default_rng(1)
    q, scale = quantize(rng.standard_normal((3, 100, 48), np.float32))  # [L, N, K]
    panels = pack_panels(q)  # [L, 2, 48, 64]
    x = rng.standard_normal((5, 48), np.float32)

    @jax.jit
    def per_layer(x, panels, scale):
        return jax.lax.map(lambda ps: panel_matmul_int8_cpu(x, ps[0], ps[1], 100), (panels, scale))

    got = np.asarray(per_layer(x, panels, scale))
    for layer in range(3):
        np.testing.assert_allclose(got[layer], panel_matmul_int8_reference(x, q[layer], scale[layer]), rtol=RTOL,
                                   atol=ATOL * np.sqrt(48))


def test_non_finite_inputs_reach_only_their_outputs():
    x = np.ones((9, 48), np.float32)
    q = np.ones((70, 48), np.int8)
    scale = np.ones(70, np.float32)
    x[2, 40] = np.nan  # row 2 only
    scale[67] = np.inf  # column 67 only (in the partial panel)
    got = np.asarray(panel_matmul_int8_cpu(x, pack_panels(q), scale, 70))
    want = panel_matmul_int8_reference(x, q, scale)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert finite.sum() == 9 * 70 - 70 - 9 + 1  # row 2 and column 67 (row 2 of column 67 counted once)


def test_empty_sides():
    got = panel_matmul_int8_cpu(np.ones((3, 0), np.float32), pack_panels(np.ones((5, 0), np.int8)),
                                np.ones(5, np.float32), 5)
    assert np.asarray(got).tolist() == np.zeros((3, 5)).tolist()
    got = panel_matmul_int8_cpu(np.ones((0, 8), np.float32), pack_panels(np.ones((5, 8), np.int8)),
                                np.ones(5, np.float32), 5)
    assert got.shape == (0, 5)


def test_rejects_bad_shapes_and_dtypes():
    panels = pack_panels(np.ones((70, 3), np.int8))  # [2, 3, 64]
    x, scale = np.ones((2, 3), np.float32), np.ones(70, np.float32)
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        panel_matmul_int8_cpu(np.ones((2, 4), np.float32), panels, scale, 70)  # K differs
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        panel_matmul_int8_cpu(x, panels, np.ones(200, np.float32), 200)  # n needs 4 panels
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        panel_matmul_int8_cpu(x, panels, np.ones(69, np.float32), 70)  # a scale per column
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        panel_matmul_int8_cpu(np.ones((2, 3, 1), np.float32), panels, scale, 70)
    with pytest.raises(ValueError, match="panels int8"):
        panel_matmul_int8_cpu(x, panels.astype(jnp.float32), scale, 70)
    with pytest.raises(ValueError, match="panels int8"):
        panel_matmul_int8_cpu(x, panels.astype(jnp.uint8), scale, 70)
    with pytest.raises(ValueError, match="must be float32"):
        panel_matmul_int8_cpu(jnp.ones((2, 3), jnp.bfloat16), panels, scale, 70)
    with pytest.raises(ValueError, match="must be float32"):
        panel_matmul_int8_cpu(x, panels, scale.astype(np.float16), 70)


def test_vmap_and_a_jitted_caller():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 40), np.float32)
    q, scale = quantize(rng.standard_normal((24, 40), np.float32))
    call = jax.jit(jax.vmap(lambda x, p, s: panel_matmul_int8_cpu(x, p, s, 24), in_axes=(0, None, None)))
    got = np.asarray(call(x, pack_panels(q), scale))
    for i in range(3):
        np.testing.assert_allclose(got[i], panel_matmul_int8_reference(x[i], q, scale), rtol=RTOL,
                                   atol=ATOL * np.sqrt(40))


def test_the_engine_uses_the_int8_kernel_at_any_vector_width(monkeypatch):
    monkeypatch.setattr(kernel_module, "vector_bits", lambda: 256)
    assert kernel_module.engine_uses_int8_kernel()
    monkeypatch.setattr(kernel_module, "int8_matmul_status", lambda: "not built")
    assert not kernel_module.engine_uses_int8_kernel()
    with pytest.raises(RuntimeError, match="not built"):
        panel_matmul_int8_cpu(np.ones((1, 3), np.float32), pack_panels(np.ones((4, 3), np.int8)),
                              np.ones(4, np.float32), 4)
