"""Built-in model presets: LLaMA-shaped configs with seeded random weights, so nothing is downloaded.

Each preset is written as a Hugging Face `config.json` dict, so it goes through the same parser as a real
checkpoint (and can be saved next to converted weights as is).
"""

from __future__ import annotations

from typing import Any

from sarathi_jax.models.config import ModelConfig

# The Llama 2 tokenizer's size: the small presets' vocabulary, and the token range of the simulator and bench.
LLAMA2_VOCAB_SIZE = 32000

_LLAMA_BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": LLAMA2_VOCAB_SIZE,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

PRESET_HF_CONFIGS: dict[str, dict[str, Any]] = {
    # ~11.3M params (8.2M of them the tied embedding); the bench's fast default.
    # head_dim 64 (not 32) so that the Pallas kernels see a realistic head size.
    "tiny-llama": {
        **_LLAMA_BASE,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    # ~50.5M params, untied LM head, GQA 8:4 like Llama 3.
    "llama-50m": {
        **_LLAMA_BASE,
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "tie_word_embeddings": False,
    },
    # GPU-sized shapes (random weights, drawn on the device). Context capped at 8192 for all three: block
    # tables are sized by max_model_len, and longer contexts only grow the per-step upload.
    # SmolLM2-135M's shape: 30 layers, hidden 576, GQA 9:3 (a group of 3), tied embedding (~135M params).
    "smollm2-135m": {
        **_LLAMA_BASE,
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Llama-3.2-1B's shape (~1.24B params): 16 layers, hidden 2048, GQA 32:8, head_dim 64, 128256 vocab, tied.
    "llama-1b": {
        **_LLAMA_BASE,
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    # Mistral-7B-v0.1's shape (~7.24B params), the paper's model: 32 layers, hidden 4096, GQA 32:8, untied.
    "mistral-7b": {
        **_LLAMA_BASE,
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}

# Presets small enough to draw and run on a CPU (tests, the CPU bench default).
CPU_PRESETS: tuple[str, ...] = ("tiny-llama", "llama-50m")

PRESETS: dict[str, ModelConfig] = {name: ModelConfig.from_hf_config(hf) for name, hf in PRESET_HF_CONFIGS.items()}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
