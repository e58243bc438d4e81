"""Fixtures of the parallelism tests: tiny HF-layout checkpoints written with numpy (no torch needed).

`tiny_checkpoint(**overrides) -> Path`: a Llama checkpoint folder (config.json + model.safetensors) with
hidden 64, 8 query heads, 4 KV heads of head_dim 16, 4 layers, MLP 128, vocab 256, untied LM head, weights
drawn N(0, 0.1) (norm weights 1 + N(0, 0.1)) so that greedy tokens are far from ties. Cached per settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from safetensors.numpy import save_file

TINY_CONFIG: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


def write_tiny_checkpoint(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    hf = {**TINY_CONFIG, **overrides}
    rng = np.random.default_rng(seed)
    e, v, m = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
    h, kv, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]

    def w(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(e)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(v, e)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": w(h * d, e),
            p + "self_attn.k_proj.weight": w(kv * d, e),
            p + "self_attn.v_proj.weight": w(kv * d, e),
            p + "self_attn.o_proj.weight": w(e, h * d),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": w(m, e),
            p + "mlp.up_proj.weight": w(m, e),
            p + "mlp.down_proj.weight": w(e, m),
        })
    tensors["model.norm.weight"] = norm()
    if not hf["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(v, e)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    built: dict[str, Path] = {}

    def get(**overrides: Any) -> Path:
        key = json.dumps(overrides, sort_keys=True)
        if key not in built:
            built[key] = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-parallel"), **overrides)
        return built[key]

    return get
