"""The decoder layers run as one `nn.scan` over stacked parameters: same logits as the unrolled layers, a
compiled step whose size does not grow with depth, the stacked KV cache updated in place, and float32
matmuls that ask for full precision."""

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
    get_model,
    init_kv_cache,
    init_random_params,
    param_shapes,
)
from sarathi_jax.models.layers import stack_layer_params, unstack_layer_params

TINY = PRESETS["tiny-llama"]
FALCON = ModelConfig.from_hf_config({
    "architectures": ["FalconForCausalLM"], "vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4,
    "num_kv_heads": 2, "num_hidden_layers": 3, "new_decoder_architecture": True, "parallel_attn": True,
    "bias": False, "alibi": False, "layer_norm_epsilon": 1e-5, "max_position_embeddings": 256,
})


def _step_inputs(config: ModelConfig, prompt_len: int, num_blocks: int, block_size: int = 4):
    """One sequence's prefill of `prompt_len` tokens (padded to 32 rows), block table 0..num_blocks-1."""
    rng = np.random.default_rng(0)
    ids = np.zeros(32, np.int32)
    ids[:prompt_len] = rng.integers(0, config.vocab_size, prompt_len)
    slots = np.full(32, -1, np.int32)
    slots[:prompt_len] = np.arange(prompt_len)
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        kv_lens=jnp.array([prompt_len, 0], jnp.int32),
        block_tables=jnp.array([list(range(num_blocks)), [0] * num_blocks], jnp.int32),
        cu_q_lens=jnp.array([0, prompt_len, prompt_len], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32),
    )
    positions = jnp.asarray(np.where(np.arange(32) < prompt_len, np.arange(32), 0), jnp.int32)
    return jnp.asarray(ids), positions, metadata, jnp.arange(2, dtype=jnp.int32) + prompt_len - 2


@pytest.mark.parametrize("config", [TINY, FALCON], ids=["llama", "falcon"])
def test_scanned_and_unrolled_layers_give_identical_logits_and_cache(config):
    params = init_random_params(config, jnp.float32, seed=3)
    unrolled = unstack_layer_params(params)
    assert "layers" not in unrolled and len([k for k in unrolled if k.startswith("layers_")]) == config.num_hidden_layers
    restacked = stack_layer_params(unrolled, config.num_hidden_layers)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, restacked))

    model = get_model(config, jnp.float32)
    inputs = _step_inputs(config, prompt_len=13, num_blocks=4)
    token_ids, positions, metadata, logits_indices = inputs
    scanned_logits, scanned_cache = jax.jit(model.apply)(
        {"params": params}, token_ids, positions, init_kv_cache(config, 4, 4, jnp.float32), metadata, logits_indices)
    unrolled_logits, unrolled_cache = jax.jit(model.clone(scan_layers=False).apply)(
        {"params": unrolled}, token_ids, positions, init_kv_cache(config, 4, 4, jnp.float32), metadata,
        logits_indices)
    np.testing.assert_allclose(np.asarray(scanned_logits), np.asarray(unrolled_logits), rtol=0, atol=1e-6)
    for got, want in zip(scanned_cache, unrolled_cache):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    assert float(jnp.std(scanned_logits)) > 0  # not a degenerate all-zero forward


def _lowered_step(num_layers: int, dtype=jnp.float32, num_blocks: int = 256):
    config = dataclasses.replace(TINY, num_hidden_layers=num_layers)
    model = get_model(config, dtype)
    sds = jax.ShapeDtypeStruct
    kv = sds((num_layers, num_blocks, 16, config.num_key_value_heads, config.head_dim), jnp.dtype(dtype))
    metadata = AttentionMetadata(slot_mapping=sds((64,), jnp.int32), kv_lens=sds((8,), jnp.int32),
                                 block_tables=sds((8, 8), jnp.int32), cu_q_lens=sds((9,), jnp.int32),
                                 num_seqs=sds((1,), jnp.int32))
    step = jax.jit(model.apply, donate_argnums=(3,))
    return step.lower({"params": param_shapes(config, dtype)}, sds((64,), jnp.int32), sds((64,), jnp.int32),
                      (kv, kv), metadata, sds((8,), jnp.int32)), kv


def test_compiled_step_does_not_grow_with_depth():
    """2 and 30 layers compile to the same program (one scanned layer body): the same number of matmuls and
    the same HLO size; the stacked KV cache is aliased in place, and the scratch memory does not grow with
    the cache (no layer's cache is sliced out, which would copy it)."""
    shallow, shallow_kv = _lowered_step(2)
    deep, deep_kv = _lowered_step(30)
    assert shallow.as_text().count("dot_general") == deep.as_text().count("dot_general") > 0
    shallow_exe, deep_exe = shallow.compile(), deep.compile()
    assert abs(len(deep_exe.as_text()) - len(shallow_exe.as_text())) < 0.01 * len(shallow_exe.as_text())
    shallow_mem, deep_mem = shallow_exe.memory_analysis(), deep_exe.memory_analysis()
    deep_kv_bytes = 2 * np.prod(deep_kv.shape) * 4
    assert deep_mem.alias_size_in_bytes >= deep_kv_bytes  # the donated cache is updated in place
    # A few bytes of loop bookkeeping may differ; a copied layer cache (2 MiB here) may not.
    assert abs(deep_mem.temp_size_in_bytes - shallow_mem.temp_size_in_bytes) < 4096
    assert deep_mem.temp_size_in_bytes < deep_kv_bytes / 10


@pytest.mark.parametrize("dtype, precision", [(jnp.float32, "HIGHEST"), (jnp.bfloat16, "DEFAULT")])
def test_matmul_precision_follows_dtype(dtype, precision):
    """float32 means float32: every matmul of the model asks for full precision (a GPU would otherwise run
    float32 matmuls as TF32); bfloat16 matmuls keep the default. (Attention computes in float32 whatever
    the dtype, at full precision: it is checked in the float32 case only.)"""
    lowered, _ = _lowered_step(2, dtype)
    operand = "f32" if dtype == jnp.float32 else "bf16"
    dots = [line for line in lowered.as_text().splitlines()
            if "stablehlo.dot_general" in line and "(tensor<" in line and f"x{operand}>, tensor<" in line]
    assert len(dots) >= 5  # qkv, o, gate_up, down (one layer body), LM head
    for line in dots:
        found = re.search(r"precision = \[(\w+), (\w+)\]", line)
        got = found.groups() if found else ("DEFAULT", "DEFAULT")
        assert got == (precision, precision), line


def test_scan_layers_default_follows_the_platform():
    from sarathi_jax.config.engine_config import resolve_scan_layers

    assert resolve_scan_layers(None, "tpu")
    assert not resolve_scan_layers(None, "cpu")
    assert not resolve_scan_layers(None, "gpu") and not resolve_scan_layers(None, "cuda")
    assert resolve_scan_layers(True, "gpu") and not resolve_scan_layers(False, "cpu")


def test_unrolled_engine_generates_the_scanned_engines_tokens():
    """The engine with unrolled layers (the GPU and CPU default), single-device and as a 2-stage pipeline
    (stage params keep their global `layers_{i}` names), gives the scanned engine's greedy tokens."""
    from sarathi_jax import EngineConfig, LLMEngine, SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (5, 19, 40)]

    def run(**overrides) -> dict[str, list[int]]:
        engine = LLMEngine(EngineConfig(model="tiny-llama", token_budget=32, num_blocks=64, max_model_len=128,
                                        **overrides))
        assert engine.config.scan_layers == overrides.get("scan_layers", False)  # the CPU default: unrolled
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=6, temperature=0.0))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = list(out.token_ids)
        return tokens

    scanned = run(scan_layers=True)
    assert run() == scanned
    assert run(scan_layers=False, pipeline_parallel_size=2) == scanned
