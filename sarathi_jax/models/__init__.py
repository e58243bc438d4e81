"""Models: config, Flax decoders, paged-KV attention metadata, checkpoint loading and the model registry.

    config, params = load_model("tiny-llama", "float32")     # a preset (random weights), an HF folder, or a
                                                               # folder converted by `python -m checkpoints_convert`
    model = get_model(config, "float32", attention_fn=None)   # Flax module; default attention is the jnp one
    logits, kv_cache = model.apply({"params": params}, token_ids, positions, kv_cache, metadata, logits_indices)

`get_model`, `param_shapes` and `param_logical_axes` dispatch on `config.architecture`: `llama.py` serves the
Llama family (Llama, Mistral, Qwen2, Qwen3), `falcon.py` serves `FalconForCausalLM`. `init_random_params`
(`random_init.py`) is generic over `param_shapes` and draws on the device, into the given shardings.
"""

from __future__ import annotations

import os
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from sarathi_jax.models import falcon, llama, random_init
from sarathi_jax.models.attention import KV_CACHE_AXES, AttentionMetadata, init_kv_cache, kv_cache_shape, write_kv
from sarathi_jax.models.config import FALCON_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from sarathi_jax.models.falcon import FalconForCausalLM
from sarathi_jax.models.llama import AttentionFn, LlamaForCausalLM
from sarathi_jax.models.loader import (
    CheckpointError,
    ParamSource,
    hf_to_params_items,
    is_orbax_checkpoint,
    load_hf_params,
    load_orbax_params,
    open_safetensors,
    param_plan,
    read_checkpoint_marker,
)
from sarathi_jax.models.presets import PRESETS, get_preset

# Architecture name (HF `architectures[0]`) -> Flax module class. The Llama family shares one implementation.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    arch: FalconForCausalLM if arch in FALCON_ARCHITECTURES else LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES
}


def _family(config: ModelConfig) -> Any:
    """The module (`llama` or `falcon`) implementing `config.architecture`."""
    if config.architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return falcon if MODEL_REGISTRY[config.architecture] is FalconForCausalLM else llama


def get_model(config: ModelConfig, dtype: Any = jnp.float32, attention_fn: AttentionFn | None = None) -> nn.Module:
    """The Flax module for `config`; `attention_fn` picks the attention backend (default: the jnp one)."""
    return _family(config).get_model(config, dtype, attention_fn=attention_fn)


def param_shapes(config: ModelConfig, dtype: Any = jnp.float32) -> Any:
    """Tree of `jax.ShapeDtypeStruct` of the (unboxed) params."""
    return _family(config).param_shapes(config, dtype)


def param_logical_axes(config: ModelConfig) -> Any:
    """Tree (same structure as the params) of `PartitionSpec`s of logical axis names; map it onto a mesh with
    `nn.logical_to_mesh_sharding(param_logical_axes(config), mesh, rules)`."""
    return _family(config).param_logical_axes(config)


def init_random_params(config: ModelConfig, dtype: Any = jnp.float32, seed: int = 0, shardings: Any = None) -> Any:
    """Seeded random params (normal std 0.02 matrices, unit norm scales, zero biases), drawn on the device(s)
    straight into `shardings` (optional tree, same structure as the params; default: the default device).
    The values depend on the seed and the param paths only; see `sarathi_jax.models.random_init`."""
    return random_init.init_random_params(config, dtype, seed, shardings)


def check_not_ambiguous(name: str) -> None:
    """A bare preset name that is also a folder here could mean either: refuse it rather than guess."""
    if name in PRESETS and os.path.isdir(name):
        raise ValueError(
            f"{name!r} is both a model preset and a folder in {os.getcwd()!r}; pass the folder as "
            f"{os.path.join('.', name)!r} (or rename it) to load it, or run from elsewhere for the preset"
        )


def load_model(
    name_or_path: str | os.PathLike[str], dtype: Any = jnp.float32, seed: int = 0, shardings: Any = None
) -> tuple[ModelConfig, Any]:
    """`(config, params)` for a preset name (seeded random weights), a Hugging Face checkpoint folder, or a
    folder converted by `python -m checkpoints_convert` (Orbax params, restored directly).

    `shardings`: optional tree (same structure as the params, e.g. from `nn.logical_to_mesh_sharding(
    param_logical_axes(config), mesh, rules)`) of one `jax.sharding.Sharding` per leaf; default: the default
    device. Converted checkpoints are restored into it shard by shard.
    """
    name = os.fspath(name_or_path)
    check_not_ambiguous(name)
    if name in PRESETS:
        config = PRESETS[name]
        return config, init_random_params(config, dtype, seed, shardings)  # each device draws its own shards
    if os.path.isdir(name):
        if is_orbax_checkpoint(name):
            read_checkpoint_marker(name)  # an interrupted conversion fails here, before anything is parsed
            config = ModelConfig.from_pretrained(name)
            return config, load_orbax_params(config, name, dtype, shardings)
        config = ModelConfig.from_pretrained(name)
        return config, load_hf_params(config, name, dtype, shardings=shardings)
    raise ValueError(f"{name!r} is neither a model preset ({', '.join(sorted(PRESETS))}) nor a checkpoint folder")


__all__ = [
    "KV_CACHE_AXES",
    "MODEL_REGISTRY",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "CheckpointError",
    "FalconForCausalLM",
    "LlamaForCausalLM",
    "ModelConfig",
    "ParamSource",
    "RopeScaling",
    "get_model",
    "get_preset",
    "hf_to_params_items",
    "init_kv_cache",
    "init_random_params",
    "is_orbax_checkpoint",
    "kv_cache_shape",
    "load_hf_params",
    "check_not_ambiguous",
    "load_model",
    "load_orbax_params",
    "open_safetensors",
    "param_logical_axes",
    "param_plan",
    "param_shapes",
    "write_kv",
]
