"""Preset weights drawn on the device (`sarathi_jax.models.random_init`), on the 8 virtual CPU devices that
tests/conftest.py asks XLA for.

Two drawing methods must give the same values: "device" (one jitted draw per shape, dtype and sharding, each
device computing its shards) and "host" (chunked draws on the CPU, then placed; what "auto" picks on CPU).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sarathi_jax.models import (
    PRESETS,
    ModelConfig,
    checkpoint_param_logical_axes,
    init_random_params,
    load_model,
    param_logical_axes,
    param_shapes,
    random_init,
)
from sarathi_jax.models.layers import INIT_STD

SDS = jax.ShapeDtypeStruct


def small_config(**overrides) -> ModelConfig:
    """Qwen2-shaped (q/k/v biases, untied head), small enough to draw in milliseconds."""
    hf = dict(architectures=["Qwen2ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
    return ModelConfig.from_hf_config({**hf, **overrides})


def tree(dtype=jnp.float32, stacked: bool = True) -> dict:
    """A hand-made params-like tree: a stacked `layers` subtree (leading layer axis) or `layers_{i}` ones."""
    layer = lambda *lead: {  # noqa: E731
        "norm": {"scale": SDS((*lead, 64), dtype)},
        "q": {"kernel": SDS((*lead, 64, 4, 16), dtype), "bias": SDS((*lead, 4, 16), dtype)},
        "o": {"kernel": SDS((*lead, 4, 16, 64), dtype)},
        "up": {"kernel": SDS((*lead, 64, 192), dtype)},
    }
    layers = {"layers": layer(3)} if stacked else {f"layers_{i}": layer() for i in range(3)}
    return {"embed_tokens": SDS((300, 64), dtype), **layers, "norm": {"scale": SDS((64,), dtype)}}


def leaves(params) -> dict[str, np.ndarray]:
    return {random_init.path_string(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def assert_same(a, b):
    la, lb = leaves(a), leaves(b)
    assert la.keys() == lb.keys()
    for name in la:
        np.testing.assert_array_equal(la[name], lb[name], err_msg=name)


def mesh(n: int, names=("tp",)) -> Mesh:
    shape = (n,) if len(names) == 1 else (2, n // 2)
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def tp_shardings(shapes, m: Mesh) -> dict:
    """Shard each leaf's last dimension divisible by the mesh (a mid dimension for 4-D q/o kernels), else
    replicate: shardings that move the sharded dimension around."""
    n = m.devices.size

    def spec(path, leaf):
        dims = [d for d, size in enumerate(leaf.shape) if size % n == 0]
        if not dims:
            return NamedSharding(m, PartitionSpec())
        d = dims[-2] if len(dims) > 2 else dims[-1]
        return NamedSharding(m, PartitionSpec(*(["tp" if i == d else None for i in range(len(leaf.shape))])))

    return jax.tree_util.tree_map_with_path(spec, shapes)


@pytest.fixture
def fresh_cache():
    """An empty draw cache (other tests share theirs: fewer compiles)."""
    random_init.clear_cache()
    yield
    random_init.clear_cache()


# -- values ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["device", "host"])
@pytest.mark.parametrize("stacked", [True, False])
def test_kinds_shapes_and_dtypes(method, stacked):
    shapes = tree(jnp.float32, stacked)
    params = random_init.init_random_tree(shapes, seed=0, method=method)
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    for (path, x), leaf in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(shapes)):
        assert x.shape == leaf.shape and x.dtype == leaf.dtype
        kind = random_init.path_string(path).rsplit("/", 1)[-1]
        if kind == "scale":
            assert np.all(np.asarray(x) == 1)
        elif kind == "bias":
            assert np.all(np.asarray(x) == 0)
        else:
            assert np.unique(np.asarray(x)).size > 0.99 * x.size  # a real draw, not a constant


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_model_params_match_param_shapes(dtype):
    config = small_config()
    shapes = param_shapes(config, dtype)
    params = init_random_params(config, dtype, seed=0)
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(lambda x: (x.shape, x.dtype), shapes)
    names = leaves(params)
    assert any(n.endswith("/bias") for n in names) and any(n.endswith("/scale") for n in names)
    for name, x in names.items():
        if name.endswith("/bias"):
            assert np.all(x == 0), name
        elif name.endswith("/scale"):
            assert np.all(x == 1), name


def test_normal_leaves_are_statistically_sane():
    config = PRESETS["tiny-llama"]
    params = init_random_params(config, jnp.float32, seed=0)
    normals = {n: x for n, x in leaves(params).items() if not n.endswith(("/scale", "/bias"))}
    for name, x in normals.items():
        x = x.astype(np.float64).ravel()
        n = x.size
        # Sample std within 6 standard errors of INIT_STD (s.e. of a std is ~ sigma / sqrt(2n)), mean within 6.
        assert abs(x.std() - INIT_STD) < 6 * INIT_STD / np.sqrt(2 * n) + 1e-7, (name, x.std())
        assert abs(x.mean()) < 6 * INIT_STD / np.sqrt(n), (name, x.mean())
        z = x / INIT_STD
        assert abs(np.mean(np.abs(z) < 1) - 0.682689) < 6 * 0.466 / np.sqrt(n), name  # Gaussian, not uniform
        assert abs(np.mean(z**4) - 3) < 6 * np.sqrt(24 / n), name  # kurtosis
        assert np.abs(z).max() < 6.5, name
    # Independent across leaves and along rows: no correlation between two leaves or between halves of one.
    embed = normals["embed_tokens"].ravel()
    other = next(x.ravel() for name, x in normals.items() if name != "embed_tokens")
    assert abs(np.corrcoef(embed[: other.size], other)[0, 1]) < 6 / np.sqrt(other.size)
    half = embed.size // 2
    assert abs(np.corrcoef(embed[:half], embed[half:])[0, 1]) < 6 / np.sqrt(half)
    # Every normal leaf is its own draw (keyed by its path), including same-shaped leaves of different layers.
    heads = [x.ravel()[:16].tobytes() for x in normals.values()]
    assert len(set(heads)) == len(heads)


def test_stacked_layers_differ_along_the_layer_axis():
    params = random_init.init_random_tree(tree(stacked=True), seed=0)
    q = np.asarray(params["layers"]["q"]["kernel"])
    assert not np.array_equal(q[0], q[1]) and not np.array_equal(q[1], q[2])


def test_deterministic_and_seed_sensitive():
    config = small_config()
    a = init_random_params(config, jnp.float32, seed=0)
    assert_same(a, init_random_params(config, jnp.float32, seed=0))
    b = init_random_params(config, jnp.float32, seed=1)
    big = init_random_params(config, jnp.float32, seed=2**40 + 1)  # any int seed (not cut to 32 bits)
    for name, x in leaves(a).items():
        if not name.endswith(("/scale", "/bias")):
            assert not np.array_equal(x, leaves(b)[name]) and not np.array_equal(x, leaves(big)[name]), name


def test_key_is_stable_and_depends_on_seed_and_path_only():
    # Pinned: a change of the key derivation changes every preset's weights; do it on purpose only.
    np.testing.assert_array_equal(random_init.leaf_key_data(0, "embed_tokens"),
                                  random_init.leaf_key_data(0, (jax.tree_util.DictKey("embed_tokens"),)))
    assert random_init.leaf_key_data(0, "a/b").tolist() != random_init.leaf_key_data(1, "a/b").tolist()
    assert random_init.leaf_key_data(0, "a/b").tolist() != random_init.leaf_key_data(0, "a/c").tolist()
    # The same path in a different tree (extra leaves, other order) gets the same values.
    small = {"embed_tokens": SDS((300, 64), jnp.float32)}
    np.testing.assert_array_equal(random_init.init_random_tree(small, 3)["embed_tokens"],
                                  random_init.init_random_tree(tree(), 3)["embed_tokens"])


def test_matches_jax_random_normal_of_the_leaf_key():
    """The values are `jax.random.normal(key, shape) * INIT_STD` with the leaf's raw threefry key."""
    shapes = {"w": SDS((33, 7, 5), jnp.float32)}
    want = jax.random.normal(jax.random.wrap_key_data(random_init.leaf_key_data(5, "w")), (33, 7, 5)) * INIT_STD
    for method in ("device", "host"):
        got = random_init.init_random_tree(shapes, 5, method=method)["w"]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=method)


def test_bfloat16_is_the_rounded_float32_draw():
    f32 = random_init.init_random_tree(tree(jnp.float32), seed=0)
    for method in ("device", "host"):
        bf16 = random_init.init_random_tree(tree(jnp.bfloat16), seed=0, method=method)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16))
        assert_same(jax.tree.map(lambda x: x.astype(jnp.bfloat16), f32), bf16)


# -- methods and shardings -------------------------------------------------------------------------------------


def test_host_and_device_methods_agree_across_chunks():
    n = random_init.CHUNK
    shapes = {"a": SDS((3, n // 2 + 5), jnp.float32), "b": SDS((7,), jnp.float32), "c": SDS((2, n), jnp.bfloat16)}
    assert_same(random_init.init_random_tree(shapes, 9, method="device"),
                random_init.init_random_tree(shapes, 9, method="host"))


def test_values_do_not_depend_on_the_global_threefry_flag():
    shapes = {"w": SDS((64, 4, 16), jnp.float32)}
    want = random_init.init_random_tree(shapes, 0, method="host")
    with jax.threefry_partitionable(False):
        got = random_init.init_random_tree(shapes, 0, method="device")
    assert_same(want, got)


@pytest.mark.parametrize(
    "n, names, dtype", [(2, ("tp",), jnp.float32), (4, ("tp",), jnp.bfloat16), (4, ("dp", "tp"), jnp.float32)]
)
def test_sharded_equals_unsharded(n, names, dtype):
    shapes = tree(dtype)
    m = mesh(n, names)
    shardings = tp_shardings(shapes, m)
    if len(names) == 2:  # also a leaf sharded over both mesh axes, on two dimensions
        shardings["up"] = NamedSharding(m, PartitionSpec("dp", "tp"))
        shapes["up"] = SDS((64, 192), dtype)
    reference = random_init.init_random_tree(shapes, seed=4, method="host")  # default device, unsharded
    for method in ("device", "auto"):  # "auto" on CPU devices: drawn on the host, placed into the shardings
        params = random_init.init_random_tree(shapes, seed=4, shardings=shardings, method=method)
        assert_same(reference, params)
        for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
            assert x.sharding == s
    assert_same(reference, random_init.init_random_tree(shapes, seed=4, method="device"))


def test_device_draw_is_shard_local():
    """Each device computes only its shard: the partitioned executable never holds the full array."""
    m = mesh(4)
    sharding = NamedSharding(m, PartitionSpec(None, "tp", None))  # heads of a (embed, heads, head_dim) kernel
    assert random_init.draw_layout((256, 8, 64), sharding)[0] == (256, 512)
    with jax.threefry_partitionable(True):
        hlo = random_init.draw_fn("normal", (256, 8, 64), jnp.float32, sharding).lower(
            np.zeros(2, np.uint32)).compile().as_text()
    shapes = set(re.findall(r"[uf]32\[([0-9,]+)\]", hlo))
    assert "256,128" in shapes and "256,2,64" in shapes
    assert not shapes & {"256,512", "256,8,64", "131072"}, shapes
    x = random_init.init_random_tree({"w": SDS((256, 8, 64), jnp.float32)}, 0, {"w": sharding}, "device")["w"]
    assert [s.data.shape for s in x.addressable_shards] == [(256, 2, 64)] * 4


def test_draw_layout_merges_unsharded_dims():
    m = mesh(4, ("dp", "tp"))
    assert random_init.draw_layout((2, 64, 4, 16), None) == ((2 * 64 * 4 * 16,), None)
    assert random_init.draw_layout((2, 64, 4, 16), NamedSharding(m, PartitionSpec()))[0] == (2048 * 4,)
    shape, s = random_init.draw_layout((2, 64, 4, 16), NamedSharding(m, PartitionSpec(None, None, "tp")))
    assert shape == (128, 64) and s.spec == PartitionSpec(None, "tp")
    shape, s = random_init.draw_layout((6, 64, 4), NamedSharding(m, PartitionSpec("dp", None, "tp")))
    assert shape == (6 * 64, 4) and s.spec == PartitionSpec("dp", "tp")
    # Uneven sharding (3 heads over 2 devices): drawn in the leaf's own shape.
    assert random_init.draw_layout((8, 3, 4), NamedSharding(m, PartitionSpec(None, "tp")))[0] == (8, 3, 4)


def test_one_compile_per_distinct_shape_dtype_and_sharding(fresh_cache):
    shapes = tree(jnp.float32, stacked=False)  # three layers of the same shapes
    m = mesh(2)
    shardings = tp_shardings(shapes, m)
    params = random_init.init_random_tree(shapes, 0, method="device")
    sharded = random_init.init_random_tree(shapes, 0, shardings, method="device")
    distinct = set()
    for (path, leaf), s in zip(jax.tree_util.tree_flatten_with_path(shapes)[0], jax.tree.leaves(shardings)):
        for sharding in (None, s):
            distinct.add((random_init.leaf_kind(path), leaf.shape, leaf.dtype, sharding))
    assert len(jax.tree.leaves(shapes)) == 17 and len(distinct) == 2 * 6
    assert random_init.cache_size() == len(distinct)
    fns = list(random_init._DRAW_FNS.values())
    assert all(fn._cache_size() == 1 for fn in fns)
    # Another seed and a second tree of the same shapes: no new function, no recompile.
    random_init.init_random_tree(shapes, 1, shardings, method="device")
    random_init.init_random_tree(tree(jnp.float32, stacked=False), 2, method="device")
    assert random_init.cache_size() == len(distinct) and all(fn._cache_size() == 1 for fn in fns)
    assert_same(params, sharded)
    # The host method compiles one chunk draw per dtype, whatever the shapes.
    random_init.clear_cache()
    random_init.init_random_tree(shapes, 0, method="host")
    random_init.init_random_tree(tree(jnp.float32, stacked=True), 0, method="host")
    assert random_init.cache_size() == 1
    random_init.init_random_tree(tree(jnp.bfloat16), 0, method="host")
    assert random_init.cache_size() == 2 and all(fn._cache_size() == 1 for fn in random_init._CHUNK_FNS.values())


@pytest.mark.parametrize("method", ["device", "host"])
def test_default_device_context_is_respected(method):
    """Draws run on worker threads; the caller's `jax.default_device` still places unsharded leaves."""
    device = jax.devices()[3]
    with jax.default_device(device):
        params = random_init.init_random_tree(tree(), 0, method=method)
    assert all(x.devices() == {device} for x in jax.tree.leaves(params))


def test_method_is_checked():
    with pytest.raises(ValueError, match="method"):
        random_init.init_random_tree(tree(), 0, method="numpy")


# -- wiring ----------------------------------------------------------------------------------------------------


def test_load_model_preset_draws_into_the_shardings():
    """Drawn in the checkpoint layout's shardings, then fused on the same devices into the model's."""
    config = PRESETS["tiny-llama"]
    rules = (("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"))
    shardings = nn.logical_to_mesh_sharding(checkpoint_param_logical_axes(config), mesh(2), rules)
    _, params = load_model("tiny-llama", jnp.float32, seed=0, shardings=shardings)
    _, plain = load_model("tiny-llama", jnp.float32, seed=0)
    assert_same(plain, params)
    serving = nn.logical_to_mesh_sharding(param_logical_axes(config), mesh(2), rules)
    for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(serving)):
        assert x.sharding == s
    assert_same(plain, random_init.init_random_params(config, jnp.float32, seed=0))
