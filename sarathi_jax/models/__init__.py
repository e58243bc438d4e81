"""Models: config, Flax decoder, paged-KV attention metadata, checkpoint loading and the model registry.

    config, params = load_model("tiny-llama", "float32")     # a preset (random weights) or an HF folder
    model = get_model(config, "float32", attention_fn=None)   # Flax module; default attention is the jnp one
    logits, kv_caches = model.apply({"params": params}, token_ids, positions, kv_caches, metadata, logits_indices)
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp

from sarathi_jax.models.attention import KV_CACHE_AXES, AttentionMetadata, init_kv_caches, kv_cache_shape, write_kv
from sarathi_jax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from sarathi_jax.models.llama import (
    LlamaForCausalLM,
    get_model,
    init_random_params,
    param_logical_axes,
    param_shapes,
)
from sarathi_jax.models.loader import CheckpointError, hf_to_params_items, load_hf_params, open_safetensors
from sarathi_jax.models.presets import PRESETS, get_preset

# Architecture name (HF `architectures[0]`) -> Flax module class. All four share one implementation.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def load_model(name_or_path: str | os.PathLike[str], dtype: Any = jnp.float32, seed: int = 0) -> tuple[ModelConfig, Any]:
    """`(config, params)` for a preset name (seeded random weights) or a Hugging Face checkpoint folder."""
    name = os.fspath(name_or_path)
    if name in PRESETS:
        config = PRESETS[name]
        return config, init_random_params(config, dtype, seed)
    if os.path.isdir(name):
        config = ModelConfig.from_pretrained(name)
        return config, load_hf_params(config, name, dtype)
    raise ValueError(f"{name!r} is neither a model preset ({', '.join(sorted(PRESETS))}) nor a checkpoint folder")


__all__ = [
    "KV_CACHE_AXES",
    "MODEL_REGISTRY",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "CheckpointError",
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeScaling",
    "get_model",
    "get_preset",
    "hf_to_params_items",
    "init_kv_caches",
    "init_random_params",
    "kv_cache_shape",
    "load_hf_params",
    "load_model",
    "open_safetensors",
    "param_logical_axes",
    "param_shapes",
    "write_kv",
]
