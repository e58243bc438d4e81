"""Falcon: config parsing, the fused-QKV split, and logits against HF transformers' `FalconForCausalLM`.

Three tiny sharded checkpoints (tests/conftest.py `falcon_checkpoint`): the new decoder architecture
(Falcon-40B/180B: GQA, ln_attn/ln_mlp, bias), the 7B style (multi-query, one input_layernorm, tied head) and
the old non-multi-query sequential layout (interleaved QKV, post_attention_layernorm).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # noqa: F401  (the oracle; must be importable, never skipped)

from sarathi_jax.models import (
    MODEL_REGISTRY,
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    FalconForCausalLM,
    ModelConfig,
    get_model,
    hf_to_params_items,
    init_kv_cache,
    init_random_params,
    load_model,
    param_logical_axes,
    param_shapes,
)
from sarathi_jax.models.falcon import falcon_qkv_rows
from tests.sarathi_jax.models.hf_oracle import (
    LAYOUTS, Chunk, float32_loader, hf_logits, make_step, model_in_layout, prompt, rel_err,
)
from tests.sarathi_jax.models.hf_oracle import full_float32_matmuls  # noqa: F401  (autouse fixture)

FALCONS = ("falcon-new", "falcon-7b", "falcon-seq")
RTOL = 1e-4


@pytest.fixture(scope="module")
def loaded(falcon_checkpoint):
    return float32_loader(falcon_checkpoint)


# ---------------------------------------------------------------------------------------------- config

FALCON_180B = {
    "alibi": False, "architectures": ["FalconForCausalLM"], "bias": False, "hidden_size": 14848,
    "layer_norm_epsilon": 1e-05, "model_type": "falcon", "multi_query": True, "new_decoder_architecture": True,
    "num_attention_heads": 232, "num_hidden_layers": 80, "num_kv_heads": 8, "parallel_attn": True,
    "torch_dtype": "bfloat16", "vocab_size": 65024, "bos_token_id": 11, "eos_token_id": 11,
}
FALCON_7B = {
    "alibi": False, "apply_residual_connection_post_layernorm": False, "architectures": ["FalconForCausalLM"],
    "bias": False, "hidden_size": 4544, "layer_norm_epsilon": 1e-05, "model_type": "falcon", "multi_query": True,
    "new_decoder_architecture": False, "num_attention_heads": 71, "num_hidden_layers": 32, "parallel_attn": True,
    "torch_dtype": "bfloat16", "vocab_size": 65024, "bos_token_id": 11, "eos_token_id": 11,
}


def test_config_real_falcon_layouts():
    big = ModelConfig.from_hf_config(FALCON_180B)
    assert (big.num_key_value_heads, big.head_dim, big.intermediate_size) == (8, 64, 4 * 14848)
    assert big.parallel_attn and big.num_ln_in_parallel_attn == 2 and big.new_decoder_architecture
    assert big.tie_word_embeddings and big.hidden_act == "gelu" and big.max_position_embeddings == 2048
    assert big.rope_theta == 10000.0 and big.rope_scaling is None and big.eos_token_ids == (11,)
    small = ModelConfig.from_hf_config(FALCON_7B)
    assert (small.num_key_value_heads, small.head_dim, small.num_ln_in_parallel_attn) == (1, 64, 1)
    assert small.parallel_attn and not small.new_decoder_architecture and not small.mlp_bias
    # The original RW key names.
    rw = {k: v for k, v in FALCON_180B.items() if k not in ("hidden_size", "num_attention_heads", "num_kv_heads",
                                                              "num_hidden_layers")}
    rw.update(n_embed=14848, n_head=232, n_head_kv=8, n_layer=80)
    assert ModelConfig.from_hf_config(rw) == big
    hash(big)


def test_config_saved_checkpoints(falcon_checkpoint):
    new = ModelConfig.from_pretrained(falcon_checkpoint("falcon-new"))
    assert (new.num_key_value_heads, new.num_ln_in_parallel_attn, new.attention_bias, new.mlp_bias) == (2, 2, True, True)
    assert not new.tie_word_embeddings and new.new_decoder_architecture
    seven = ModelConfig.from_pretrained(falcon_checkpoint("falcon-7b"))
    assert (seven.num_key_value_heads, seven.num_ln_in_parallel_attn, seven.attention_bias) == (1, 1, False)
    assert seven.tie_word_embeddings and seven.parallel_attn
    seq = ModelConfig.from_pretrained(falcon_checkpoint("falcon-seq"))
    assert seq.num_key_value_heads == 4 and not seq.parallel_attn


def test_config_errors():
    assert "FalconForCausalLM" in SUPPORTED_ARCHITECTURES
    with pytest.raises(ValueError, match=r"alibi=True .* not supported"):
        ModelConfig.from_hf_config(dict(FALCON_7B, alibi=True))
    with pytest.raises(ValueError, match="unsupported Falcon activation 'relu'"):
        ModelConfig.from_hf_config(dict(FALCON_7B, activation="relu"))
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        ModelConfig.from_hf_config(dict(FALCON_7B, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ValueError, match="Falcon-only"):  # parallel_attn=True on a Llama
        dataclasses.replace(ModelConfig.from_hf_config(FALCON_7B), architecture="LlamaForCausalLM", hidden_act="silu")


# ---------------------------------------------------------------------------------------------- layout


def _hf_split(fused: np.ndarray, heads: int, kv_heads: int, head_dim: int, new_arch: bool, multi_query: bool):
    """transformers' `FalconAttention._split_heads` on the rows of a fused weight (rows = output features)."""
    rest = fused.shape[1:]
    if new_arch:
        qkv = fused.reshape(kv_heads, heads // kv_heads + 2, head_dim, *rest)
        return (qkv[:, :-2].reshape(heads * head_dim, *rest), qkv[:, -2].reshape(kv_heads * head_dim, *rest),
                qkv[:, -1].reshape(kv_heads * head_dim, *rest))
    if not multi_query:
        qkv = fused.reshape(heads, 3, head_dim, *rest)
        return tuple(qkv[:, j].reshape(heads * head_dim, *rest) for j in range(3))
    qkv = fused.reshape(heads + 2, head_dim, *rest)
    return (qkv[:-2].reshape(heads * head_dim, *rest), qkv[-2].reshape(head_dim, *rest),
            qkv[-1].reshape(head_dim, *rest))


@pytest.mark.parametrize("new_arch,multi_query,heads,kv_heads", [
    (True, True, 8, 2), (True, True, 6, 6), (False, True, 5, 1), (False, False, 3, 3),
])
def test_fused_qkv_rows_match_hf_split(new_arch, multi_query, heads, kv_heads):
    head_dim = 4
    config = dataclasses.replace(
        ModelConfig.from_hf_config(FALCON_7B), num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, hidden_size=heads * head_dim, new_decoder_architecture=new_arch,
    )
    fused = np.arange((heads + 2 * kv_heads) * head_dim * 3).reshape(-1, 3)
    want = _hf_split(fused, heads, kv_heads, head_dim, new_arch, multi_query)
    for rows, expected in zip(falcon_qkv_rows(config), want):
        np.testing.assert_array_equal(np.concatenate([fused[a:b] for a, b in rows]), expected)


def test_registry_axes_and_random_init():
    config = ModelConfig.from_hf_config(dict(FALCON_180B, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                                             num_hidden_layers=2, vocab_size=128))
    assert MODEL_REGISTRY["FalconForCausalLM"] is FalconForCausalLM
    assert isinstance(get_model(config), FalconForCausalLM)
    params = init_random_params(config, jnp.float32, seed=0)
    axes = param_logical_axes(config)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    assert jax.tree.structure(axes, is_leaf=is_spec) == jax.tree.structure(params)
    layer = axes["layers"]  # stacked over a leading "layers" axis (one nn.scan)
    assert tuple(layer["self_attention"]["qkv_proj"]["kernel"]) == ("layers", "embed", "kv_heads", "qkv", "head_dim")
    assert tuple(layer["self_attention"]["dense"]["kernel"]) == ("layers", "heads", "head_dim", "embed")
    assert tuple(layer["mlp"]["dense_h_to_4h"]["kernel"]) == ("layers", "embed", "mlp")
    assert set(layer) == {"ln_attn", "ln_mlp", "self_attention", "mlp"} and "lm_head" not in params
    shapes = param_shapes(config)
    assert jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(lambda x: x.shape, params)


def test_missing_and_misshaped_fused_tensor_are_named(falcon_checkpoint):
    from safetensors import safe_open

    folder = falcon_checkpoint("falcon-new")
    config = ModelConfig.from_pretrained(folder)
    table = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="numpy") as f:
            table.update({name: f.get_tensor(name) for name in f.keys()})
    name = "transformer.h.1.self_attention.query_key_value.weight"
    bad = dict(table, **{name: table[name][:64]})
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(64, 64\), expected \(128, 64\)"):
        list(hf_to_params_items(config, bad.__getitem__))
    del table["transformer.h.0.ln_mlp.bias"]
    with pytest.raises(CheckpointError, match="missing tensor 'transformer.h.0.ln_mlp.bias'"):
        list(hf_to_params_items(config, table.__getitem__))


# ---------------------------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("name", FALCONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_prompt_matches_hf(loaded, name, layout):
    folder, config, params = loaded(name)
    model, params = model_in_layout(config, params, layout)
    ids = prompt(config, 21, seed=1)
    kv_cache = init_kv_cache(config, 8, 4, jnp.float32)
    token_ids, positions, metadata, logits_indices = make_step([Chunk(ids, 0, list(range(6)))], 32, 2, 6, 4)
    logits, (k_pages, v_pages) = jax.jit(model.apply)({"params": params}, token_ids, positions, kv_cache, metadata,
                                                      logits_indices)
    assert logits.shape == (21, config.vocab_size)
    assert rel_err(logits, hf_logits(folder, ids)) < RTOL
    # [layers, blocks, block_size, kv_heads, head_dim]; padding rows wrote nothing in any layer.
    assert k_pages.shape[0] == config.num_hidden_layers and k_pages.shape[3] == config.num_key_value_heads
    assert not np.any(np.asarray(k_pages[:, 6:])) and not np.any(np.asarray(v_pages[:, 6:]))


@pytest.mark.parametrize("name", ["falcon-new", "falcon-7b"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_prefill_ragged_batch_and_decode_match_hf(loaded, name, layout):
    """Two sequences: one prefilled in chunks 12 + 7 then decoded, one alongside in the same steps."""
    folder, config, params = loaded(name)
    model, params = model_in_layout(config, params, layout)
    apply = jax.jit(model.apply, donate_argnums=(3,))
    ids_a, ids_b = prompt(config, 20, seed=4), prompt(config, 9, seed=5)
    ref_a, ref_b = hf_logits(folder, ids_a), hf_logits(folder, ids_b)
    table_a, table_b = [7, 2, 9, 0, 4], [1, 11, 5]
    kv_cache = init_kv_cache(config, 12, 4, jnp.float32)
    steps = [
        ([Chunk(ids_a[:12], 0, table_a), Chunk(ids_b[:5], 0, table_b)], [(ref_a, 0, 12), (ref_b, 0, 5)]),
        ([Chunk(ids_a[12:19], 12, table_a), Chunk(ids_b[5:], 5, table_b)], [(ref_a, 12, 19), (ref_b, 5, 9)]),
        ([Chunk(ids_a[19:], 19, table_a)], [(ref_a, 19, 20)]),
    ]
    for chunks, refs in steps:
        token_ids, positions, metadata, logits_indices = make_step(chunks, 32, 3, 6, 4)
        logits, kv_cache = apply({"params": params}, token_ids, positions, kv_cache, metadata, logits_indices)
        row = 0
        for ref, start, stop in refs:
            assert rel_err(logits[row : row + stop - start], ref[start:stop]) < RTOL, (name, start)
            row += stop - start


def test_pipeline_stages_compose(loaded):
    """`layer_range` stages (the pipeline-parallel hook) give the same logits as the whole model; a stage
    holds its slice of the stacked layer params and its own layers' KV cache."""
    _, config, params = loaded("falcon-new")
    ids = prompt(config, 10, seed=6)
    token_ids, positions, metadata, logits_indices = make_step([Chunk(ids, 0, [0, 1, 2])], 16, 1, 3, 4)
    whole, _ = jax.jit(get_model(config).apply)({"params": params}, token_ids, positions,
                                                init_kv_cache(config, 3, 4, jnp.float32), metadata, logits_indices)

    def stage_params(start: int, end: int) -> dict:
        return {**params, "layers": jax.tree.map(lambda x: x[start:end], params["layers"])}

    first = jax.jit(get_model(config).clone(layer_range=(0, 1)).apply)
    second = jax.jit(get_model(config).clone(layer_range=(1, 2)).apply)
    hidden, _ = first({"params": stage_params(0, 1)}, token_ids, positions,
                      init_kv_cache(config, 3, 4, jnp.float32, num_layers=1), metadata, logits_indices)
    logits, _ = second({"params": stage_params(1, 2)}, hidden, positions,
                       init_kv_cache(config, 3, 4, jnp.float32, num_layers=1), metadata, logits_indices)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_bfloat16_and_load_model(falcon_checkpoint):
    folder = falcon_checkpoint("falcon-7b")
    config, params = load_model(str(folder), jnp.bfloat16)
    assert isinstance(get_model(config, jnp.bfloat16), FalconForCausalLM)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    ids = prompt(config, 16, seed=7)
    token_ids, positions, metadata, logits_indices = make_step([Chunk(ids, 0, [0, 1, 2, 3])], 16, 1, 4, 4)
    logits, _ = jax.jit(get_model(config, jnp.bfloat16).apply)(
        {"params": params}, token_ids, positions, init_kv_cache(config, 4, 4, jnp.bfloat16), metadata, logits_indices
    )
    assert rel_err(logits, hf_logits(folder, ids)) < 5e-2
