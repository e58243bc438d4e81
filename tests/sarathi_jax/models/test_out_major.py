"""The projection layouts of a CPU (`sarathi_jax.models.out_major`): the out-major product in both of its forms and
the panel product against a float64 numpy tensordot, the relayout of a whole model's params, and which layout a
runner takes. The HF oracle tests of test_llama.py and test_falcon.py run every architecture in every layout; the
engine tests run the one this machine's CPU runner uses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sarathi_jax.models import get_model, load_model, param_logical_axes, to_out_major, use_out_major
from pallas_kernels.panel_matmul_cpu import pack_panels
from sarathi_jax.models import out_major
from sarathi_jax.models.out_major import (
    IN_MAJOR, LEFT_MAX_ROWS, OUT_MAJOR, PANELS, out_major_product, panel_product, panel_shape, projection_layout,
)

HIGHEST = jax.lax.Precision.HIGHEST


@pytest.mark.parametrize("rows", [1, 5, LEFT_MAX_ROWS, LEFT_MAX_ROWS + 3])  # weight left, and right past the limit
@pytest.mark.parametrize("kernel_shape, num_contracting", [((24, 3, 4, 8), 1), ((4, 8, 24), 2), ((40, 24), 1)])
def test_product_equals_tensordot(rows, kernel_shape, num_contracting):
    rng = np.random.default_rng(rows)
    kernel = rng.standard_normal(kernel_shape).astype(np.float32)
    x = rng.standard_normal((rows, *kernel_shape[:num_contracting])).astype(np.float32)
    want = np.tensordot(x.astype(np.float64), kernel.astype(np.float64), axes=num_contracting)
    out_major_kernel = np.moveaxis(kernel, list(range(num_contracting)), list(range(-num_contracting, 0)))
    got = jax.jit(out_major_product, static_argnums=(2, 3))(x, np.ascontiguousarray(out_major_kernel),
                                                            num_contracting, HIGHEST)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_relayout_moves_only_the_projections():
    config, params = load_model("tiny-llama", "float32")
    model, moved = to_out_major(get_model(config, jnp.float32), params)
    assert model.projection_layout == OUT_MAJOR
    axes = param_logical_axes(config)
    flat_in = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_out = dict(jax.tree_util.tree_flatten_with_path(moved)[0])
    is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)  # noqa: E731
    flat_axes = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=is_spec)[0])
    num_moved = 0
    for path, x in flat_in:
        y = flat_out[path]
        names = tuple(flat_axes[path])
        if path[-1].key == "kernel":
            # [layers, in..., out...] -> [layers, out..., in...]: the contracting axes go last.
            num_in = 2 if names[1:3] == ("heads", "head_dim") else 1
            want = np.moveaxis(np.asarray(x), list(range(1, 1 + num_in)), list(range(-num_in, 0)))
            num_moved += 1
        else:
            want = np.asarray(x)
        np.testing.assert_array_equal(np.asarray(y), want)
    assert num_moved == 4  # qkv, out, and the MLP's two


def test_out_major_only_on_a_cpu():
    assert use_out_major("cpu") and not use_out_major("gpu") and not use_out_major("tpu")


@pytest.mark.parametrize("rows", [1, 5, 33, 100])
@pytest.mark.parametrize("kernel_shape, num_contracting", [((24, 3, 4, 8), 1), ((4, 8, 24), 2), ((40, 130), 1)])
def test_panel_product_equals_tensordot(rows, kernel_shape, num_contracting):
    rng = np.random.default_rng(rows)
    kernel = rng.standard_normal(kernel_shape).astype(np.float32)  # [in..., out...]
    x = rng.standard_normal((rows, *kernel_shape[:num_contracting])).astype(np.float32)
    want = np.tensordot(x.astype(np.float64), kernel.astype(np.float64), axes=num_contracting)
    in_shape, out_shape = kernel_shape[:num_contracting], kernel_shape[num_contracting:]
    panels = pack_panels(kernel.reshape(np.prod(in_shape), -1).T)  # [out, in] -> panels
    assert panels.shape == panel_shape(out_shape, in_shape)
    got = jax.jit(panel_product, static_argnums=(2, 3))(x, panels, out_shape, num_contracting)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_relayout_to_panels_packs_only_the_projections():
    config, params = load_model("tiny-llama", "float32")
    model = get_model(config, jnp.float32)
    _, moved = to_out_major(model, params)
    panel_model, packed = to_out_major(model, params, panels=True)
    assert panel_model.projection_layout == PANELS
    flat_moved = jax.tree_util.tree_flatten_with_path(moved)[0]
    flat_packed = dict(jax.tree_util.tree_flatten_with_path(packed)[0])
    num_packed = 0
    for path, x in flat_moved:
        y = np.asarray(flat_packed[path])
        x = np.asarray(x)
        if path[-1].key == "kernel":
            # [layers, out..., in...] -> [layers, out, in] -> [layers, panels, in, 64]
            num_in = 2 if path[-2].key == "o_proj" else 1  # o_proj contracts heads and head_dim
            k = int(np.prod(x.shape[x.ndim - num_in:]))
            np.testing.assert_array_equal(y, np.asarray(pack_panels(x.reshape(x.shape[0], -1, k))))
            num_packed += 1
        else:
            np.testing.assert_array_equal(y, x)
    assert num_packed == 4  # qkv, out, and the MLP's two (stacked over the layers)


def test_a_runner_takes_panels_for_float32_on_one_cpu_where_the_kernel_is_used(monkeypatch):
    assert projection_layout("gpu", single_device=True, dtype=jnp.float32) == IN_MAJOR
    assert projection_layout("cpu", single_device=False, dtype=jnp.float32) == IN_MAJOR
    assert projection_layout("cpu", single_device=True, dtype=jnp.bfloat16) == OUT_MAJOR
    for uses in (True, False):
        monkeypatch.setattr(out_major, "engine_uses_kernel", lambda uses=uses: uses)
        assert projection_layout("cpu", single_device=True, dtype=jnp.float32) == (PANELS if uses else OUT_MAJOR)


def test_int8_weights_take_panels_on_one_cpu_wherever_the_int8_kernel_is_built(monkeypatch):
    for uses in (True, False):
        monkeypatch.setattr(out_major, "engine_uses_int8_kernel", lambda uses=uses: uses)
        monkeypatch.setattr(out_major, "engine_uses_kernel", lambda: False)  # an AVX2 build: float32 stays out-major
        for dtype in (jnp.float32, jnp.bfloat16):
            assert projection_layout("cpu", single_device=True, dtype=dtype, quantization="int8") == (
                PANELS if uses else OUT_MAJOR)
        assert projection_layout("cpu", single_device=True, dtype=jnp.float32) == OUT_MAJOR
    assert projection_layout("cpu", single_device=True, dtype=jnp.float32, quantization="fp8") == OUT_MAJOR
    assert projection_layout("cpu", single_device=False, dtype=jnp.float32, quantization="int8") == IN_MAJOR
    assert projection_layout("gpu", single_device=True, dtype=jnp.bfloat16, quantization="int8") == IN_MAJOR


def test_int8_panels_pack_the_8bit_kernels_and_keep_the_scales():
    config, params = load_model("tiny-llama", "float32", quantization="int8")
    model = get_model(config, jnp.float32)
    panel_model, packed = to_out_major(model, params, panels=True)
    assert panel_model.projection_layout == PANELS
    qkv = packed["layers"]["self_attn"]["qkv_proj"]
    assert qkv["kernel"].dtype == jnp.int8 and qkv["kernel"].shape[-1] == 64
    np.testing.assert_array_equal(np.asarray(qkv["kernel_scale"]),
                                  np.asarray(params["layers"]["self_attn"]["qkv_proj"]["kernel_scale"]))
