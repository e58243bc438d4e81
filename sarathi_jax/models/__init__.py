"""Models: config, Flax decoders, paged-KV attention metadata, checkpoint loading and the model families.

    config, params = load_model("tiny-llama", "float32")     # a preset (random weights), an HF folder, or a
                                                               # folder converted by `python -m checkpoints_convert`
    model = get_model(config, "float32", attention_fn=None)   # Flax module; default attention is the jnp one
    logits, kv_cache = model.apply({"params": params}, token_ids, positions, kv_cache, metadata, logits_indices)

Where each piece lives:

    config.py        ModelConfig (parsed from an HF config.json), the supported architectures
    presets.py       built-in configs (random weights, nothing downloaded)
    attention.py     the paged KV cache: AttentionMetadata, write_kv, init_kv_cache
    layers.py        the layers the decoders share: projections, RMSNorm, RoPE, paged self-attention, the
                     decoder itself (`PagedDecoderLM`), stack/unstack of the scanned layer params
    out_major.py     projection weights on a CPU: stored [out, in] (the weight as the dot's left operand), or
                     packed into column panels for the C++ matmuls (float32 on AVX-512; int8)
    fusion.py        fused q/k/v and gate/up projections: the checkpoint layout (separate) -> the model's,
                     `fuse_projections`, applied once at load time
    llama.py         the Llama family (Llama, Mistral, Qwen2, Qwen3) and its HF parameter mapping
    falcon.py        FalconForCausalLM and its HF parameter mapping (fused QKV split)
    families.py      the one architecture -> family lookup: get_model, param_shapes, param_logical_axes,
                     param_plan, the checkpoint layout's shapes and logical axes, and to_out_major
    quantization.py  8-bit projection weights (int8, fp8) with per-output-channel scales (ModelConfig.quantization)
    param_source.py  ParamSource: a parameter's HF tensor and reshape, as data
    loader.py        load_model; safetensors and Orbax loading
    random_init.py   init_random_params: seeded random weights drawn on the device, into the given shardings

Exports resolve lazily, so `sarathi_jax.models.config` and `.presets` (plain Python) load without JAX.
"""

from __future__ import annotations

from sarathi_jax.utils.lazy_exports import lazy_exports

# Exported name -> the submodule that defines it.
_EXPORTS = {
    "ModelConfig": "config",
    "RopeScaling": "config",
    "SUPPORTED_ARCHITECTURES": "config",
    "PRESETS": "presets",
    "get_preset": "presets",
    "KV_CACHE_AXES": "attention",
    "AttentionMetadata": "attention",
    "init_kv_cache": "attention",
    "kv_cache_shape": "attention",
    "write_kv": "attention",
    "AttentionFn": "layers",
    "stack_layer_params": "layers",
    "unstack_layer_params": "layers",
    "fuse_projections": "fusion",
    "to_out_major": "families",
    "use_out_major": "out_major",
    "projection_layout": "out_major",
    "LlamaForCausalLM": "llama",
    "FalconForCausalLM": "falcon",
    "MODEL_FAMILIES": "families",
    "checkpoint_param_logical_axes": "families",
    "checkpoint_param_shapes": "families",
    "MODEL_REGISTRY": "families",
    "ModelFamily": "families",
    "get_model": "families",
    "model_family": "families",
    "param_logical_axes": "families",
    "param_plan": "families",
    "param_shapes": "families",
    "ParamSource": "param_source",
    "CheckpointError": "loader",
    "check_not_ambiguous": "loader",
    "hf_to_params_items": "loader",
    "is_orbax_checkpoint": "loader",
    "load_hf_params": "loader",
    "load_model": "loader",
    "load_model_config": "loader",
    "load_orbax_params": "loader",
    "open_safetensors": "loader",
    "read_checkpoint_marker": "loader",
    "init_random_params": "random_init",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, {name: f"{__name__}.{module}" for name, module in _EXPORTS.items()})
