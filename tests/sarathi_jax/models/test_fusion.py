"""Fused projections (`sarathi_jax.models.fusion`): the fused kernels compute what the separate ones did (float64
numpy reference), with replicated KV heads too; the tree transform in place, sharded, stacked or unrolled;
the checkpoint layout derived from the model's agrees with the HF plans; and a decoder layer lowers to 4 weight
matmuls (7 before q/k/v and gate/up were fused)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sarathi_jax.models import (
    PRESETS,
    AttentionMetadata,
    ModelConfig,
    checkpoint_param_shapes,
    fuse_projections,
    get_model,
    param_plan,
    param_shapes,
    unstack_layer_params,
)
from sarathi_jax.models import fusion
from sarathi_jax.models.fusion import checkpoint_layout, fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from sarathi_jax.parallel.plan import make_plan

FALCON_NEW = ModelConfig.from_hf_config({
    "architectures": ["FalconForCausalLM"], "vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4,
    "num_kv_heads": 2, "num_hidden_layers": 2, "new_decoder_architecture": True, "parallel_attn": True,
    "bias": True, "alibi": False, "layer_norm_epsilon": 1e-5, "max_position_embeddings": 256,
})
FALCON_7B = ModelConfig.from_hf_config({
    "architectures": ["FalconForCausalLM"], "vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4,
    "num_hidden_layers": 2, "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
    "bias": False, "alibi": False, "layer_norm_epsilon": 1e-5, "max_position_embeddings": 256,
})


def _qwen(**overrides) -> ModelConfig:
    hf = dict(architectures=["Qwen2ForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
    return ModelConfig.from_hf_config({**hf, **overrides})


CONFIGS = {
    "llama": PRESETS["tiny-llama"],
    "qwen2-bias": _qwen(),
    "qwen3-qk-norm": _qwen(architectures=["Qwen3ForCausalLM"], head_dim=16, attention_bias=True),
    "falcon-new": FALCON_NEW,
    "falcon-7b": FALCON_7B,
}


# -- the math --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads, kv_heads, replication", [(8, 2, 1), (8, 2, 2), (8, 2, 4), (4, 1, 2), (6, 6, 1)])
def test_fused_qkv_kernel_and_bias_compute_the_separate_projections(heads, kv_heads, replication):
    """Against float64 numpy einsums over the separate kernels: fused q heads are the checkpoint's q heads in
    order, each (expanded) KV head's k and v are those of the KV head its query heads read in HF's GQA grouping
    (query head h -> KV head h // (heads // kv_heads)), and the bias rides along."""
    rng = np.random.default_rng(0)
    tokens, embed, head_dim = 5, 12, 4
    x = rng.standard_normal((tokens, embed))
    q, k, v = (rng.standard_normal((embed, n, head_dim)).astype(np.float32) for n in (heads, kv_heads, kv_heads))
    qb, kb, vb = (rng.standard_normal((n, head_dim)).astype(np.float32) for n in (heads, kv_heads, kv_heads))
    kernel = np.asarray(fuse_qkv(q, k, v, replication), np.float64)
    bias = np.asarray(fuse_qkv(qb, kb, vb, replication), np.float64)
    expanded, per_kv = kv_heads * replication, heads // (kv_heads * replication)
    assert kernel.shape == (embed, expanded, per_kv + 2, head_dim) and bias.shape == kernel.shape[1:]

    out = np.einsum("te,ekgd->tkgd", x, kernel) + bias  # one matmul
    got_q, got_k, got_v = (np.asarray(a) for a in split_qkv(out))
    want_q = np.einsum("te,ehd->thd", x, q.astype(np.float64)) + qb
    want_k = np.einsum("te,ehd->thd", x, k.astype(np.float64)) + kb
    want_v = np.einsum("te,ehd->thd", x, v.astype(np.float64)) + vb
    np.testing.assert_allclose(got_q, want_q, rtol=1e-12, atol=1e-12)
    for h in range(heads):  # the model's query head h reads expanded KV head h // per_kv
        np.testing.assert_allclose(got_k[:, h // per_kv], want_k[:, h // (heads // kv_heads)], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_v[:, h // per_kv], want_v[:, h // (heads // kv_heads)], rtol=1e-12, atol=1e-12)
    if replication == 1:  # split is the inverse of fuse
        for got, want in zip(split_qkv(kernel), (q, k, v)):
            np.testing.assert_array_equal(got, want)


def test_fused_gate_up_computes_the_separate_projections():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8))
    gate, up = (rng.standard_normal((8, 6)).astype(np.float32) for _ in range(2))
    kernel = np.asarray(fuse_gate_up(gate, up), np.float64)
    assert kernel.shape == (8, 2, 6)
    got_gate, got_up = split_gate_up(np.einsum("te,ecf->tcf", x, kernel))
    np.testing.assert_allclose(got_gate, x @ gate.astype(np.float64), rtol=1e-12)
    np.testing.assert_allclose(got_up, x @ up.astype(np.float64), rtol=1e-12)


# -- the tree --------------------------------------------------------------------------------------------------


def _checkpoint_tree(config: ModelConfig, seed: int = 0) -> dict:
    """Random host arrays in the checkpoint layout (a fresh tree: fuse_projections empties what it fuses)."""
    rng = np.random.default_rng(seed)
    shapes = checkpoint_param_shapes(config)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)


@pytest.mark.parametrize("name", CONFIGS)
def test_fuse_projections_gives_the_models_tree_and_splits_back(name):
    config = CONFIGS[name]
    checkpoint = _checkpoint_tree(config)
    params = fuse_projections(_checkpoint_tree(config))
    shapes = param_shapes(config)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(lambda x: (x.shape, x.dtype), shapes)
    back = checkpoint_layout(params, lambda fusion, x: fusion.split(x))
    assert jax.tree.structure(back) == jax.tree.structure(checkpoint)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(checkpoint)):
        np.testing.assert_array_equal(np.asarray(got), want)
    # Unrolled layers (`layers_{i}`) fuse layer by layer to the same values.
    unrolled = fuse_projections(unstack_layer_params(_checkpoint_tree(config)))
    assert jax.tree.all(jax.tree.map(np.array_equal, unrolled, unstack_layer_params(params)))


def test_fuse_projections_works_in_place():
    tree = _checkpoint_tree(PRESETS["tiny-llama"])
    attn, mlp = tree["layers"]["self_attn"], tree["layers"]["mlp"]
    assert fuse_projections(tree) is tree
    assert set(attn) == {"qkv_proj", "o_proj"} and set(mlp) == {"gate_up_proj", "down_proj"}


def test_fusion_frees_the_parts_as_it_goes(monkeypatch):
    """Device memory peaks at the weights plus the fused leaf being made: each part leaves the tree, and the
    device, as soon as its fused leaf exists (never the whole model twice)."""
    baseline = sum(x.nbytes for x in jax.live_arrays())
    params = jax.tree.map(jnp.asarray, _checkpoint_tree(PRESETS["tiny-llama"]))
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    excess = []  # live bytes beyond the weights and the new fused leaf, when each fused leaf is made
    make = fusion._fuse_fn

    def recording(*key):
        fn = make(*key)

        def call(*parts):
            out = jax.block_until_ready(fn(*parts))
            excess.append(sum(x.nbytes for x in jax.live_arrays()) - baseline - weights - out.nbytes)
            return out

        return call

    monkeypatch.setattr(fusion, "_fuse_fn", recording)
    fuse_projections(params)
    assert len(excess) == 2 and max(excess) <= 0  # qkv_proj, gate_up_proj
    assert sum(x.nbytes for x in jax.live_arrays()) - baseline == weights


@pytest.mark.parametrize("name", CONFIGS)
def test_checkpoint_shapes_are_the_hf_plans(name):
    """The checkpoint layout derived from the model's parameters is what the HF plan (and so converted
    checkpoints) holds: the same paths, each stacked over the layers."""
    config = CONFIGS[name]
    want = {}
    for source in param_plan(config):
        want[source.param_path] = source.shape if source.layer is None else (config.num_hidden_layers, *source.shape)
    shapes = checkpoint_param_shapes(config)
    got = {tuple(k.key for k in path): x.shape for path, x in jax.tree_util.tree_leaves_with_path(shapes)}
    assert got == want


@pytest.mark.parametrize("kv_heads, tp", [(4, 2), (2, 4), (1, 2)])
def test_sharded_fusion_with_replicated_kv_heads(kv_heads, tp):
    """Read into the loading shardings (q over heads; k/v replicated when KV heads are fewer than devices), the
    fused kernel comes out in the serving sharding of the plan's model (KV heads expanded): each device's shard
    holds its KV head's k and v and that KV head's query heads."""
    config = dataclasses.replace(PRESETS["tiny-llama"], num_attention_heads=8, num_key_value_heads=kv_heads)
    plan = make_plan(config, tensor_parallel_size=tp)
    host = _checkpoint_tree(config)
    want = fuse_projections(_checkpoint_tree(config), plan.kv_replication)  # unsharded, on the default device
    placed = jax.tree.map(jax.device_put, host, plan.param_shardings(for_loading=True))
    params = fuse_projections(placed, plan.kv_replication)
    serving = plan.param_shardings()
    assert jax.tree.map(lambda x: x.shape, params) == jax.tree.map(lambda x: x.shape, param_shapes(plan.model_config))
    for got, expected, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(want), jax.tree.leaves(serving)):
        assert got.sharding.is_equivalent_to(sharding, got.ndim)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    qkv = params["layers"]["self_attn"]["qkv_proj"]["kernel"]  # [layers, embed, kv_heads * r, per_kv + 2, head_dim]
    q = host["layers"]["self_attn"]["q_proj"]["kernel"]
    k = host["layers"]["self_attn"]["k_proj"]["kernel"]
    per_kv = 8 // plan.model_config.num_key_value_heads
    for shard in qkv.addressable_shards:
        for j in range(*shard.index[2].indices(qkv.shape[2])):  # the expanded KV heads on this device
            local = np.asarray(shard.data)[:, :, j - shard.index[2].start]
            np.testing.assert_array_equal(local[:, :, :per_kv], q[:, :, j * per_kv:(j + 1) * per_kv])
            np.testing.assert_array_equal(local[:, :, per_kv], k[:, :, j // plan.kv_replication])


# -- the lowered layer -----------------------------------------------------------------------------------------


def _dot_count(config: ModelConfig, num_layers: int) -> int:
    """`dot_general`s in the lowered step of an unrolled model with `num_layers` layers, whose attention is a
    stub that returns q (so it contributes no dot)."""
    config = dataclasses.replace(config, num_hidden_layers=num_layers)
    model = get_model(config, jnp.float32, attention_fn=lambda q, *args, **kwargs: q).clone(scan_layers=False)
    sds = jax.ShapeDtypeStruct
    kv = sds((num_layers, 4, 4, config.num_key_value_heads, config.head_dim), jnp.float32)
    metadata = AttentionMetadata(slot_mapping=sds((8,), jnp.int32), kv_lens=sds((2,), jnp.int32),
                                 block_tables=sds((2, 2), jnp.int32), cu_q_lens=sds((3,), jnp.int32),
                                 num_seqs=sds((1,), jnp.int32))
    params = jax.eval_shape(unstack_layer_params, param_shapes(config))
    lowered = jax.jit(model.apply).lower({"params": params}, sds((8,), jnp.int32), sds((8,), jnp.int32), (kv, kv),
                                         metadata, sds((2,), jnp.int32))
    return len(re.findall(r"stablehlo\.dot_general", lowered.as_text()))


@pytest.mark.parametrize("name", CONFIGS)
def test_a_decoder_layer_runs_four_weight_matmuls(name):
    """Each added (unrolled) layer adds exactly its weight matmuls to the lowered step; the LM head and the
    embedding lookup (a gather) are outside the layers and cancel in the difference. Llama: qkv_proj, o_proj,
    gate_up_proj, down_proj (7 before fusion: q, k, v, o, gate, up, down). Falcon: qkv_proj, dense,
    dense_h_to_4h, dense_4h_to_h (6 before: its MLP has no gate). Biases and q/k norms add no matmul."""
    config = CONFIGS[name]
    per_layer = _dot_count(config, 3) - _dot_count(config, 2)
    assert per_layer == 4
    assert _dot_count(config, 2) == 2 * 4 + 1 + 2  # plus the LM head and the step's RoPE cos/sin (`materialized`)
