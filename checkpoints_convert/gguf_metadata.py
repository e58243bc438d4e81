"""GGUF metadata -> what an HF checkpoint folder holds beside its tensors: the tensor names, `config.json`
(with Llama 3's RoPE scaling recovered from `rope_freqs.weight`), the stop ids of `generation_config.json`,
and `tokenizer.json` / `tokenizer_config.json` (see gguf_source.py's module doc).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from checkpoints_convert.converter import ConversionError


class TensorShape(Protocol):
    shape: tuple[int, ...]  # HF shape


class GGUFFile(Protocol):
    """What this module reads of an opened GGUF file (`gguf_source.GGUFCheckpoint`)."""

    path: Path
    metadata: dict[str, Any]  # decoded metadata fields, by GGUF key
    raw_tensors: Mapping[str, Any]  # gguf.ReaderTensor by GGUF name
    infos: Mapping[str, TensorShape]  # by HF name

    @property
    def tokens(self) -> list[str]: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    def meta(self, key: str, default: Any = None) -> Any: ...

    def chat_template(self) -> str | None: ...

    def token(self, key: str) -> str | None: ...


# GGUF tensor names (per layer after "blk.N.") -> HF names (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tokens that end an assistant turn in common chat templates; added to the stop ids when the template emits them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


def gguf_to_hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor (None: a tensor the model does not use, e.g. `rope_freqs.weight`)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def llama3_rope_parameters(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any]:
    """HF `rope_parameters` (rope_type "llama3") that reproduce llama.cpp's `rope_freqs.weight`.

    llama.cpp stores Llama 3's RoPE scaling as one divisor per frequency, `factors [head_dim // 2]`, not as the
    four HF numbers. The largest divisor is `factor`. In the blended band, `1 / f = (1 - s) / factor + s` with
    `s = (orig / wavelen - low) / (high - low)`, which is linear in `1 / wavelen`; its slope and intercept fix
    the band, and any (orig, low, high) with the same two give the same rotation. Llama 3's own low_freq_factor
    1 is taken, which recovers the released models' numbers exactly. With a single blended frequency the line
    is underdetermined and Llama 3's high_freq_factor 4 is taken too. The result is checked against `factors`
    through the model's own RoPE formula; a file that does not follow Llama 3's scheme is refused.
    """
    from sarathi_jax.models.config import RopeScaling
    from sarathi_jax.models.layers import rope_inv_freq

    factors = np.asarray(factors, np.float64)
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    inv_wavelen = inv_freq / (2 * np.pi)
    factor = float(factors.max())
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor) if factor > 1 else np.zeros_like(factors)
    middle = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if middle.sum() >= 2:
        slope, intercept = np.polyfit(inv_wavelen[middle], smooth[middle], 1)
        orig = round(-slope / intercept) if intercept < 0 else 0
        high = 1 + orig / slope if orig > 0 else 0.0
    elif middle.sum() == 1:
        orig, high = round(float((3 * smooth[middle][0] + 1) / inv_wavelen[middle][0])), 4.0
    else:
        orig, high = 0, 0.0
    if orig < 1 or not high > 1:
        raise ConversionError(f"rope_freqs.weight does not follow Llama 3's RoPE scaling (factors {factors.tolist()})")
    params = {"rope_type": "llama3", "rope_theta": rope_theta, "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": float(round(high, 6)), "original_max_position_embeddings": orig}
    scaling = RopeScaling(**{k: v for k, v in params.items() if k != "rope_theta"})
    expected = (inv_freq / factors).astype(np.float32)
    if not np.allclose(rope_inv_freq(head_dim, rope_theta, scaling), expected, rtol=1e-4, atol=0):
        raise ConversionError(f"rope_freqs.weight does not follow Llama 3's RoPE scaling (factors {factors.tolist()})")
    return params


def hf_config(checkpoint: GGUFFile) -> dict[str, Any]:
    """An HF `config.json` (LlamaForCausalLM, transformers 5 layout) from the `llama.*` metadata."""
    hidden = int(checkpoint.meta("embedding_length"))
    head_dim = int(checkpoint.meta("attention.key_length", hidden // checkpoint.num_heads))
    rope_dim = checkpoint.meta("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ConversionError(f"partial rotary embeddings (rope.dimension_count {rope_dim} != head_dim "
                              f"{head_dim}) are not supported")
    scaling = checkpoint.meta("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ConversionError(f"GGUF rope scaling {scaling!r} is not supported (only Llama 3's, stored as "
                              "rope_freqs.weight)")
    rope_theta = float(checkpoint.meta("rope.freq_base", 10000.0))
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if "rope_freqs.weight" in checkpoint.raw_tensors:
        t = checkpoint.raw_tensors["rope_freqs.weight"]
        factors = np.asarray(t.data, np.float32).reshape(-1)
        if t.tensor_type.name != "F32" or factors.shape != (head_dim // 2,):
            raise ConversionError(f"rope_freqs.weight: expected {head_dim // 2} F32 values, got "
                                  f"{factors.shape} {t.tensor_type.name}")
        rope_parameters = llama3_rope_parameters(factors, rope_theta, head_dim)
    vocab_size = len(checkpoint.tokens) or int(checkpoint.meta("vocab_size"))
    emb = checkpoint.infos.get("model.embed_tokens.weight")
    if emb is not None and emb.shape[0] != vocab_size:
        vocab_size = emb.shape[0]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(checkpoint.meta("feed_forward_length")),
        "num_hidden_layers": int(checkpoint.meta("block_count")),
        "num_attention_heads": checkpoint.num_heads,
        "num_key_value_heads": checkpoint.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(checkpoint.meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(checkpoint.meta("context_length", 2048)),
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": "lm_head.weight" not in checkpoint.infos,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": checkpoint.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": checkpoint.metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": checkpoint.metadata.get("tokenizer.ggml.padding_token_id"),
        # Dequantized weights are float32 values: keep them exact unless --dtype says otherwise.
        "dtype": "float32",
    }
    if checkpoint.metadata.get("general.name"):
        config["_name_or_path"] = checkpoint.metadata["general.name"]
    return config


def stop_token_ids(checkpoint: GGUFFile) -> list[int]:
    """EOS, then the end-of-turn ids: `eot_token_id` / `eom_token_id`, and known end-of-turn tokens that
    the chat template writes."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = checkpoint.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    template = checkpoint.chat_template() or ""
    if template:
        index = {tok: i for i, tok in enumerate(checkpoint.tokens)} if checkpoint.tokens else {}
        for token in END_OF_TURN_TOKENS:
            if token in template and token in index and index[token] not in ids:
                ids.append(index[token])
    return ids


def write_tokenizer_files(checkpoint: GGUFFile, out: Path) -> None:
    """`tokenizer.json` (through transformers' GGUF tokenizer converter) and `tokenizer_config.json`."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError as e:
        raise ConversionError(
            "building tokenizer.json from a GGUF vocabulary needs HF transformers (>= 5, with its GGUF "
            "tokenizer converter): pip install transformers"
        ) from e
    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(checkpoint.path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    backend.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {k: v for k, v in tokenizer_config.items() if v is not None}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token = checkpoint.token(key)
        if token is not None:
            config.setdefault(name, token)
    if "tokenizer.ggml.add_bos_token" in checkpoint.metadata:
        config["add_bos_token"] = bool(checkpoint.metadata["tokenizer.ggml.add_bos_token"])
    template = checkpoint.chat_template()
    if template:
        config["chat_template"] = template
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
