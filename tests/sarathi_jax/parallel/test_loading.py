"""`sarathi_jax.parallel.loading`: reading only the config (presets, HF folders, an interrupted conversion,
unknown names), refusing a bad split before any weight is read, and restoring weights straight into their
tensor-parallel shards."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from sarathi_jax.models import PRESETS
from sarathi_jax.models.loader import CHECKPOINT_MARKER, ORBAX_PARAMS_DIR, CheckpointError
from sarathi_jax.parallel import loading
from sarathi_jax.parallel.distributed import ENV_COORDINATOR_ADDRESS


def test_load_model_config_of_a_preset_and_of_an_hf_folder(tiny_checkpoint):
    assert loading.load_model_config("tiny-llama") == PRESETS["tiny-llama"]
    assert loading.load_model_config("tiny-llama", "int8").quantization == "int8"
    config = loading.load_model_config(tiny_checkpoint())
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (64, 4, 8, 4, 256)


def test_load_model_config_refuses_unknown_names_and_interrupted_conversions(tmp_path):
    with pytest.raises(ValueError, match="neither a model preset"):
        loading.load_model_config(tmp_path / "missing")
    (tmp_path / (ORBAX_PARAMS_DIR + ".partial_save")).mkdir()
    assert not (tmp_path / CHECKPOINT_MARKER).exists()
    with pytest.raises(CheckpointError, match="incomplete converted checkpoint"):
        loading.load_model_config(tmp_path)


def test_a_bad_split_fails_before_any_weight_is_read(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv(ENV_COORDINATOR_ADDRESS, raising=False)

    def no_load(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(loading, "load_model", no_load)
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=3"):
        loading.load_parallel_model(tiny_checkpoint(), np.float32, 0, 3, 1)
    with pytest.raises(ValueError, match="exceeds num_hidden_layers=4"):
        loading.load_parallel_model(tiny_checkpoint(), np.float32, 0, 1, 5)


def test_weights_are_restored_into_their_tensor_parallel_shards(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv(ENV_COORDINATOR_ADDRESS, raising=False)
    folder = tiny_checkpoint()
    plan, config, params = loading.load_parallel_model(folder, np.float32, 0, 2, 1)
    assert plan.tensor_parallel_size == 2 and plan.pipeline_parallel_size == 1
    assert config == loading.load_model_config(folder)
    qkv = params["layers"]["self_attn"]["qkv_proj"]["kernel"]
    assert qkv.shape == (4, 64, 4, 4, 16)  # layers, hidden, kv heads, 2 q heads + k + v, head_dim
    assert len(qkv.devices()) == 2 and not qkv.sharding.is_fully_replicated
    assert {shard.data.shape for shard in qkv.addressable_shards} == {(4, 64, 2, 4, 16)}  # 2 KV heads per device
    # The values are the checkpoint's: layer 0's q_proj rows are heads x head_dim by hidden, k_proj's kv_heads x
    # head_dim; KV head g's slots are query heads 2g, 2g + 1, then its k and v.
    hf = load_file(str(folder / "model.safetensors"))
    q = hf["model.layers.0.self_attn.q_proj.weight"].T.reshape(64, 4, 2, 16)
    k = hf["model.layers.0.self_attn.k_proj.weight"].T.reshape(64, 4, 16)
    np.testing.assert_array_equal(np.asarray(qkv[0, :, :, :2]), q)
    np.testing.assert_array_equal(np.asarray(qkv[0, :, :, 2]), k)
    for leaf in jax.tree_util.tree_leaves(params):
        assert set(leaf.devices()) <= set(jax.devices()[:2])
