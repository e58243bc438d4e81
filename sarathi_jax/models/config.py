"""`ModelConfig`: the model shape and flags, parsed from a Hugging Face `config.json`.

One frozen, hashable dataclass covers the four supported decoder families; the differences between them
are flags (`attention_bias`, `attention_out_bias`, `qk_norm`, `tie_word_embeddings`) and the RoPE settings.
Being hashable, a `ModelConfig` can be a static attribute of a Flax module and a `jax.jit` static argument.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style RoPE frequency scaling (`rope_type == "llama3"`); the only scaling supported."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # q/k/v projection bias (Qwen2 always; Llama and Qwen3 when `attention_bias` is set).
    attention_bias: bool
    # o projection bias (Llama and Qwen3 follow `attention_bias`; Qwen2 and Mistral never have one).
    attention_out_bias: bool
    # Qwen3: per-head RMSNorm over head_dim on q and k, before RoPE.
    qk_norm: bool
    # Mistral-style sliding-window attention, recorded only when smaller than max_position_embeddings.
    # The model itself attends to the full context, so it is exact only for sequences no longer than the
    # window: the engine caps max_model_len to it (see `max_model_len`).
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def max_model_len(self) -> int:
        """Longest sequence this model computes exactly: max_position_embeddings, capped by sliding_window."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> "ModelConfig":
        """Parse a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        architectures = hf_config.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(
                f"config.json must name exactly one architecture, got {architectures!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden_act = hf_config.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' (SwiGLU) is supported")
        if hf_config.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")

        num_attention_heads = int(hf_config["num_attention_heads"])
        num_key_value_heads = int(hf_config.get("num_key_value_heads") or num_attention_heads)
        hidden_size = int(hf_config["hidden_size"])
        head_dim = hf_config.get("head_dim") or hidden_size // num_attention_heads
        max_position_embeddings = int(hf_config.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling = _parse_rope(hf_config)

        bias = bool(hf_config.get("attention_bias", False))
        if architecture == "Qwen2ForCausalLM":
            attention_bias, attention_out_bias = True, False
        elif architecture == "MistralForCausalLM":
            attention_bias, attention_out_bias = False, False
        else:
            attention_bias, attention_out_bias = bias, bias

        return cls(
            architecture=architecture,
            vocab_size=int(hf_config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf_config["intermediate_size"]),
            num_hidden_layers=int(hf_config["num_hidden_layers"]),
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            attention_out_bias=attention_out_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=_parse_sliding_window(hf_config, architecture, max_position_embeddings),
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf_config.get("eos_token_id")),
            torch_dtype=hf_config.get("dtype") or hf_config.get("torch_dtype"),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> "ModelConfig":
        """Read `<path>/config.json`. EOS ids listed in `generation_config.json` are added (Llama 3 Instruct
        lists its end-of-turn tokens only there)."""
        with open(os.path.join(path, "config.json")) as f:
            config = cls.from_hf_config(json.load(f))
        generation_config_path = os.path.join(path, "generation_config.json")
        if os.path.exists(generation_config_path):
            with open(generation_config_path) as f:
                extra_eos = _as_id_tuple(json.load(f).get("eos_token_id"))
            merged = config.eos_token_ids + tuple(i for i in extra_eos if i not in config.eos_token_ids)
            config = dataclasses.replace(config, eos_token_ids=merged)
        return config


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _parse_rope(hf_config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5.x writes `rope_parameters` (with rope_theta inside); 4.x writes `rope_theta` and
    # `rope_scaling` at the top level. Legacy `rope_scaling` dicts may say "type" instead of "rope_type".
    rope_parameters = hf_config.get("rope_parameters") or {}
    legacy_scaling = hf_config.get("rope_scaling")
    scaling = legacy_scaling if legacy_scaling is not None else rope_parameters
    rope_theta = float(rope_parameters.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    if rope_type == "llama3":
        return rope_theta, RopeScaling(
            rope_type="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _parse_sliding_window(hf_config: Mapping[str, Any], architecture: str, max_position_embeddings: int) -> int | None:
    window = hf_config.get("sliding_window")
    # Qwen2/Qwen3 configs carry a sliding_window value that is off unless use_sliding_window is set.
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not hf_config.get("use_sliding_window", False):
        return None
    if window is None or int(window) >= max_position_embeddings:
        return None
    return int(window)
