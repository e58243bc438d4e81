"""Out-major projection weights (`sarathi_jax.models.out_major`): the product in both of its forms against a
float64 numpy tensordot, and the relayout of a whole model's params. The HF oracle tests of test_llama.py and
test_falcon.py run every architecture in both layouts; the engine tests run it (a CPU runner uses it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sarathi_jax.models import get_model, load_model, param_logical_axes, to_out_major, use_out_major
from sarathi_jax.models.out_major import LEFT_MAX_ROWS, out_major_product

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
    assert model.out_major_projections
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
