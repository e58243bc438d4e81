"""Model tests: config parsing, checkpoint loading, and logits against HF transformers' PyTorch forward.

The oracle tests need torch: they import it at module level so that a missing torch fails loudly.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # noqa: F401  (the oracle; must be importable, never skipped)
from pallas_kernels import ragged_paged_attention_xla
from safetensors import safe_open
from safetensors.numpy import save_file

from sarathi_jax.models import (
    KV_CACHE_AXES,
    PRESETS,
    CheckpointError,
    ModelConfig,
    RopeScaling,
    get_model,
    hf_to_params_items,
    init_kv_cache,
    init_random_params,
    load_hf_params,
    load_model,
    open_safetensors,
    param_logical_axes,
    param_shapes,
    write_kv,
)
from sarathi_jax.models.presets import CPU_PRESETS
from sarathi_jax.models.layers import unstack_layer_params
from tests.sarathi_jax.models.hf_oracle import (
    LAYOUTS, Chunk, float32_loader, hf_logits, make_step, model_in_layout, prompt, rel_err,
)
from tests.sarathi_jax.models.hf_oracle import full_float32_matmuls  # noqa: F401  (autouse fixture)

ARCHITECTURES = ("llama", "llama3", "llama-mqa", "mistral", "qwen2", "qwen3")
RTOL = 1e-4


@pytest.fixture(scope="module")
def loaded(hf_checkpoint):
    """name -> (folder, config, float32 params), loaded once per module."""
    return float32_loader(hf_checkpoint)


# ---------------------------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_prompt_matches_hf(loaded, name, layout):
    folder, config, params = loaded(name)
    model, params = model_in_layout(config, params, layout)
    block_size, num_blocks = 4, 8
    ids = prompt(config, 21, seed=1)
    kv_cache = init_kv_cache(config, num_blocks, block_size, jnp.float32)
    step = make_step([Chunk(ids, 0, list(range(6)))], num_tokens=32, max_num_seqs=2, max_blocks=6,
                     block_size=block_size)
    token_ids, positions, metadata, logits_indices = step
    logits, (k_pages, v_pages) = jax.jit(model.apply)({"params": params}, token_ids, positions, kv_cache,
                                                      metadata, logits_indices)
    assert logits.dtype == jnp.float32 and logits.shape == (21, config.vocab_size)
    assert rel_err(logits, hf_logits(folder, ids)) < RTOL
    # Padding rows (slot -1) wrote nothing: blocks 6 and 7 were never in the table and stay zero, in every layer;
    # every layer wrote its own blocks 0..5.
    assert k_pages.shape[0] == config.num_hidden_layers
    assert not np.any(np.asarray(k_pages[:, 6:])) and not np.any(np.asarray(v_pages[:, 6:]))
    assert all(np.any(np.asarray(k_pages[layer, :6])) for layer in range(config.num_hidden_layers))


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ragged_batch_matches_hf(loaded, name, layout):
    folder, config, params = loaded(name)
    model, params = model_in_layout(config, params, layout)
    block_size = 4
    seq_a, seq_b = prompt(config, 7, seed=2), prompt(config, 13, seed=3)
    kv_cache = init_kv_cache(config, 16, block_size, jnp.float32)
    chunks = [Chunk(seq_a, 0, [9, 3]), Chunk(seq_b, 0, [0, 14, 5, 11])]
    token_ids, positions, metadata, logits_indices = make_step(chunks, 32, max_num_seqs=3, max_blocks=4,
                                                               block_size=block_size)
    logits, _ = jax.jit(model.apply)({"params": params}, token_ids, positions, kv_cache, metadata, logits_indices)
    logits = np.asarray(logits)
    assert rel_err(logits[:7], hf_logits(folder, seq_a)) < RTOL
    assert rel_err(logits[7:20], hf_logits(folder, seq_b)) < RTOL


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_prefill_and_decode_match_hf(loaded, name, layout):
    """Prefill 12 + 7 tokens through the paged cache (shuffled block table), then decode 1 token."""
    folder, config, params = loaded(name)
    model, params = model_in_layout(config, params, layout)
    apply = jax.jit(model.apply, donate_argnums=(3,))
    block_size, num_blocks = 4, 12
    ids = prompt(config, 20, seed=4)
    ref = hf_logits(folder, ids)
    block_table = np.random.default_rng(5).permutation(num_blocks)[:5].tolist()
    kv_cache = init_kv_cache(config, num_blocks, block_size, jnp.float32)
    start = 0
    for chunk_len in (12, 7, 1):
        chunk = Chunk(ids[start : start + chunk_len], start, block_table)
        token_ids, positions, metadata, logits_indices = make_step([chunk], 16, max_num_seqs=2, max_blocks=6,
                                                                   block_size=block_size)
        logits, kv_cache = apply({"params": params}, token_ids, positions, kv_cache, metadata, logits_indices)
        assert rel_err(logits, ref[start : start + chunk_len]) < RTOL, f"chunk at {start}"
        start += chunk_len


def test_bfloat16_smoke(hf_checkpoint):
    folder = hf_checkpoint("llama")
    config, params = load_model(str(folder), jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    model = get_model(config, jnp.bfloat16)
    ids = prompt(config, 21, seed=1)
    kv_cache = init_kv_cache(config, 8, 4, jnp.bfloat16)
    token_ids, positions, metadata, logits_indices = make_step([Chunk(ids, 0, list(range(6)))], 32, 2, 6, 4)
    logits, new_cache = jax.jit(model.apply)({"params": params}, token_ids, positions, kv_cache, metadata,
                                             logits_indices)
    assert logits.dtype == jnp.float32
    assert new_cache[0].dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(logits)))
    assert rel_err(logits, hf_logits(folder, ids)) < 5e-2


# ---------------------------------------------------------------------------------------------- config


def test_config_from_saved_checkpoints(hf_checkpoint):
    llama = ModelConfig.from_pretrained(hf_checkpoint("llama"))
    assert (llama.architecture, llama.num_key_value_heads, llama.head_dim) == ("LlamaForCausalLM", 2, 16)
    assert not llama.tie_word_embeddings and llama.rope_scaling is None and llama.eos_token_ids == (2,)
    llama3 = ModelConfig.from_pretrained(hf_checkpoint("llama3"))
    assert llama3.rope_theta == 500000.0 and llama3.tie_word_embeddings
    assert llama3.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    mistral = ModelConfig.from_pretrained(hf_checkpoint("mistral"))
    assert mistral.sliding_window == 4096 and mistral.max_model_len == 4096
    qwen2 = ModelConfig.from_pretrained(hf_checkpoint("qwen2"))
    assert qwen2.attention_bias and not qwen2.attention_out_bias and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_pretrained(hf_checkpoint("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.attention_out_bias
    hash(qwen3)  # usable as a static jit argument / module attribute


LEGACY_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_config_legacy_layout():
    config = ModelConfig.from_hf_config(LEGACY_LLAMA31)
    assert config.head_dim == 128 and config.rope_theta == 500000.0 and config.torch_dtype == "bfloat16"
    assert config.eos_token_ids == (128001, 128008, 128009) and config.rope_scaling.factor == 8.0
    assert config.sliding_window is None and config.max_model_len == 131072
    # Old configs say "type", and "default" means no scaling.
    old = dict(LEGACY_LLAMA31, rope_scaling={"type": "default"}, eos_token_id=None)
    config = ModelConfig.from_hf_config(old)
    assert config.rope_scaling is None and config.eos_token_ids == ()


def test_config_errors():
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM"):
        ModelConfig.from_hf_config(dict(LEGACY_LLAMA31, architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        ModelConfig.from_hf_config(dict(LEGACY_LLAMA31, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        ModelConfig.from_hf_config(dict(LEGACY_LLAMA31, rope_scaling=None,
                                        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}))


def test_config_qwen_sliding_window_only_when_enabled():
    qwen = dict(LEGACY_LLAMA31, architectures=["Qwen2ForCausalLM"], rope_scaling=None, sliding_window=4096)
    assert ModelConfig.from_hf_config(qwen).sliding_window is None
    assert ModelConfig.from_hf_config(dict(qwen, use_sliding_window=True)).sliding_window == 4096


def test_generation_config_eos_merged(hf_checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("llama-mqa"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_pretrained(folder).eos_token_ids == (2, 7)


# ---------------------------------------------------------------------------------------------- loader


def test_sharded_checkpoint_and_tokenizer(hf_checkpoint):
    from tokenizers import Tokenizer

    folder = hf_checkpoint("llama")
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode("the quick brown fox").ids
    assert ids[0] == 1 and max(ids) < ModelConfig.from_pretrained(folder).vocab_size
    assert tokenizer.decode(ids) == "the quick brown fox"


def _checkpoint_tensors(folder: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="numpy") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    source = hf_checkpoint("qwen2")
    tensors = _checkpoint_tensors(source)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    shutil.copy(source / "config.json", tmp_path / "config.json")
    save_file(tensors, tmp_path / "model.safetensors")
    config = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.self_attn.k_proj.bias'"):
        load_hf_params(config, tmp_path)


def test_misshaped_tensor_is_named(hf_checkpoint):
    folder = hf_checkpoint("llama")
    config = ModelConfig.from_pretrained(folder)
    tensors = _checkpoint_tensors(folder)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:, :32]
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \(128, 32\), "
                                              r"expected \(128, 64\)"):
        list(hf_to_params_items(config, tensors.__getitem__))


def test_missing_checkpoint_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        with open_safetensors(tmp_path):
            pass


# ---------------------------------------------------------------------------------------------- pieces


@pytest.mark.parametrize("layer", [0, 1])
def test_write_kv_drops_padding_rows(layer):
    k_pages = jnp.zeros((2, 3, 2, 1, 4))  # [layers, blocks, block_size, kv_heads, head_dim]
    v_pages = jnp.ones((2, 3, 2, 1, 4))
    k = jnp.arange(3 * 4, dtype=jnp.float32).reshape(3, 1, 4) + 1
    k_new, v_new = write_kv(k_pages, v_pages, k, -k, jnp.array([5, -1, 0], jnp.int32), jnp.int32(layer))
    np.testing.assert_array_equal(k_new[layer, 2, 1, 0], k[0, 0])
    np.testing.assert_array_equal(k_new[layer, 0, 0, 0], k[2, 0])
    np.testing.assert_array_equal(v_new[layer, 2, 1, 0], -k[0, 0])
    # Only this layer's two slots changed: the other layer and the padding row's target are untouched.
    assert int(jnp.count_nonzero(k_new)) == 8 and int(jnp.count_nonzero(k_new[1 - layer])) == 0
    assert int(jnp.sum(v_new == 1)) == 2 * 3 * 2 * 4 - 8


@pytest.mark.parametrize("name, low, high", [("smollm2-135m", 134e6, 135e6), ("llama-1b", 1.23e9, 1.24e9),
                                             ("mistral-7b", 7.24e9, 7.25e9)])
def test_gpu_preset_shapes(name, low, high):
    """The GPU-sized presets have their models' parameter counts (from shapes; nothing is drawn on a CPU)."""
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes(PRESETS[name])))
    assert low <= num_params <= high


@pytest.mark.parametrize("name", CPU_PRESETS)
def test_presets(name):
    config, params = load_model(name, jnp.float32)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    assert {"tiny-llama": 5e6 <= num_params <= 15e6, "llama-50m": 45e6 <= num_params <= 55e6}[name]
    # Logical axes tree matches the params tree, and kernels keep the heads axis explicit.
    axes = param_logical_axes(config)
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) == \
        jax.tree.structure(params)
    # Layers are stacked on a leading "layers" axis (one nn.scan); q/k/v and gate/up are fused (fusion.py).
    assert tuple(axes["layers"]["self_attn"]["qkv_proj"]["kernel"]) == ("layers", "embed", "kv_heads", "qkv",
                                                                        "head_dim")
    assert tuple(axes["layers"]["mlp"]["gate_up_proj"]["kernel"]) == ("layers", "embed", "gate_up", "mlp")
    assert params["layers"]["mlp"]["gate_up_proj"]["kernel"].shape[0] == config.num_hidden_layers
    assert len(KV_CACHE_AXES) == 5 and KV_CACHE_AXES[0] == "layers" and KV_CACHE_AXES[3] == "kv_heads"
    # Same seed, same weights.
    again = init_random_params(config, jnp.float32, seed=0)
    assert np.array_equal(params["embed_tokens"], again["embed_tokens"])


def test_preset_logits_are_sane():
    config, params = load_model("tiny-llama", jnp.float32)
    model = get_model(config, jnp.float32)
    ids = prompt(config, 16, seed=6)
    token_ids, positions, metadata, logits_indices = make_step([Chunk(ids, 0, [0, 1])], 16, 1, 2, 8)
    logits, _ = jax.jit(model.apply)({"params": params}, token_ids, positions,
                                     init_kv_cache(config, 2, 8, jnp.float32), metadata, logits_indices)
    std = float(jnp.std(logits))
    assert np.all(np.isfinite(np.asarray(logits))) and 0.05 < std < 5.0


def test_attention_fn_is_pluggable(loaded):
    _, config, params = loaded("llama-mqa")
    calls: list[tuple[int, ...]] = []

    def recording_attention(q, *args, **kwargs):
        calls.append(q.shape)
        return ragged_paged_attention_xla(q, *args, **kwargs)

    # Traced only (jax.eval_shape): which calls the model makes is all this checks.
    model = get_model(config, jnp.float32, attention_fn=recording_attention)
    token_ids, positions, metadata, logits_indices = make_step([Chunk([3, 4, 5], 0, [0])], 16, 1, 1, 4)
    cache = init_kv_cache(config, 1, 4, jnp.float32)
    logits, _ = jax.eval_shape(model.apply, {"params": params}, token_ids, positions, cache, metadata,
                               logits_indices)
    assert logits.shape[-1] == config.vocab_size
    # Scanned: the layer body (and so the attention call) is traced a fixed number of times, whatever the depth.
    assert set(calls) == {(16, config.num_attention_heads, config.head_dim)}
    traces = len(calls)
    deeper = dataclasses.replace(config, num_hidden_layers=3 * config.num_hidden_layers)
    calls.clear()
    jax.eval_shape(get_model(deeper, jnp.float32, attention_fn=recording_attention).apply,
                   {"params": init_random_params(deeper, jnp.float32)}, token_ids, positions,
                   init_kv_cache(deeper, 1, 4, jnp.float32), metadata, logits_indices)
    assert len(calls) == traces
    calls.clear()
    jax.eval_shape(model.clone(scan_layers=False).apply, {"params": unstack_layer_params(params)}, token_ids,
                   positions, cache, metadata, logits_indices)
    assert calls == [(16, config.num_attention_heads, config.head_dim)] * config.num_hidden_layers


def test_load_model_unknown_name():
    with pytest.raises(ValueError, match="tiny-llama"):
        load_model("no-such-model")


def test_preset_name_that_is_also_a_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-llama").mkdir()
    with pytest.raises(ValueError, match=r"both a model preset and a folder.*'\./tiny-llama'"):
        load_model("tiny-llama")

