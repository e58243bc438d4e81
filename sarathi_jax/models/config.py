"""`ModelConfig`: the model shape and flags, parsed from a Hugging Face `config.json`.

One frozen, hashable dataclass covers the supported decoder families; the differences between the Llama-style
ones are flags (`attention_bias`, `attention_out_bias`, `qk_norm`, `tie_word_embeddings`) and the RoPE settings.
Falcon (`FalconForCausalLM`, its own Flax module in `falcon.py`) adds the fields after `torch_dtype`
(`hidden_act`, `mlp_bias`, `parallel_attn`, `num_ln_in_parallel_attn`, `new_decoder_architecture`); they keep
their Llama defaults for the other families.
Being hashable, a `ModelConfig` can be a static attribute of a Flax module and a `jax.jit` static argument.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

# HF `architectures[0]` values per model family (`families.py` maps each to its implementation).
LLAMA_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
FALCON_ARCHITECTURES: tuple[str, ...] = ("FalconForCausalLM",)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = LLAMA_ARCHITECTURES + FALCON_ARCHITECTURES
# Falcon's `activation` values that the Falcon module implements: exact (erf) GELU and its tanh approximations.
FALCON_ACTIVATIONS: tuple[str, ...] = ("gelu", "gelu_new", "gelu_pytorch_tanh")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")
# `quantization` values: the decoder layers' projections stored 8-bit (`quantization.py` says how).
QUANTIZATIONS: tuple[str, ...] = ("int8", "fp8")


def check_quantization(quantization: str | None) -> None:
    """ValueError unless `quantization` is None or one of `QUANTIZATIONS`."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {quantization!r}")


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
    # Epsilon of every norm layer: RMSNorm for the Llama family, LayerNorm (`layer_norm_epsilon`) for Falcon.
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
    # ---- Falcon (defaults are the Llama family's, so existing constructors are unchanged) ----
    # MLP activation: "silu" (Llama's gated SwiGLU MLP) or a Falcon GELU (plain two-matrix MLP).
    hidden_act: str = "silu"
    # Bias on the MLP matrices (Falcon's `bias` flag covers q/k/v, the output projection and the MLP).
    mlp_bias: bool = False
    # Attention and MLP both read the layer input and their outputs are added to it together (Falcon);
    # False is the sequential pre-norm layer (Llama, Falcon with parallel_attn=False).
    parallel_attn: bool = False
    # With parallel_attn: 2 = separate `ln_attn` / `ln_mlp` norms (Falcon-40B/180B), 1 = one `input_layernorm`.
    num_ln_in_parallel_attn: int = 1
    # Falcon's fused query_key_value layout: True = grouped [kv_heads, q_per_kv + 2, head_dim] (40B/180B);
    # False = [heads + 2, head_dim] when multi-query (7B), else interleaved [heads, 3, head_dim].
    new_decoder_architecture: bool = False
    # ---- how the weights are held ----
    # The decoder layers' projections stored 8-bit with per-output-channel scales: None (the model dtype), "int8"
    # or "fp8" (`quantization.py`). Not read from config.json: the engine sets it (`EngineConfig.quantization`) or
    # a converted folder's marker does.
    quantization: str | None = None

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
        is_falcon = self.architecture in FALCON_ARCHITECTURES
        allowed_acts = FALCON_ACTIVATIONS if is_falcon else ("silu",)
        if self.hidden_act not in allowed_acts:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r} for {self.architecture}; supported: {', '.join(allowed_acts)}"
            )
        check_quantization(self.quantization)
        if self.num_ln_in_parallel_attn not in (1, 2):
            raise ValueError(f"num_ln_in_parallel_attn must be 1 or 2, got {self.num_ln_in_parallel_attn}")
        if not is_falcon and (self.parallel_attn or self.new_decoder_architecture or self.mlp_bias):
            raise ValueError(f"parallel_attn / new_decoder_architecture / mlp_bias are Falcon-only, not {self.architecture}")

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
        quantized = hf_config.get("quantization_config")
        if quantized is not None:
            method = quantized.get("quant_method", "unnamed") if isinstance(quantized, Mapping) else quantized
            raise ValueError(
                f"this checkpoint is already quantized ({method!r} quantization_config in config.json), a format "
                "this engine does not read; load its float (unquantized) weights, with quantization='int8' or "
                "'fp8' to quantize them here"
            )
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if architecture in FALCON_ARCHITECTURES:
            return cls._from_falcon_config(hf_config, architecture)
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
    def _from_falcon_config(cls, hf_config: Mapping[str, Any], architecture: str) -> "ModelConfig":
        """Falcon's config.json (also the original RW key names `n_embed`, `n_head`, `n_head_kv`, `n_layer`).

        Rotary Falcon only: `alibi=True` (Falcon-RW style ALiBi biases) is rejected.
        """
        if hf_config.get("alibi", False):
            raise ValueError(
                "alibi=True (ALiBi attention biases) is not supported for FalconForCausalLM; "
                "only rotary Falcon models (alibi=false: Falcon-7B/40B/180B) are"
            )
        if hf_config.get("apply_residual_connection_post_layernorm", False):
            raise ValueError("apply_residual_connection_post_layernorm=True is not supported for FalconForCausalLM")
        activation = hf_config.get("activation", "gelu")
        if activation not in FALCON_ACTIVATIONS:
            raise ValueError(f"unsupported Falcon activation {activation!r}; supported: {', '.join(FALCON_ACTIVATIONS)}")

        def get(*keys: str, default: Any = None) -> Any:
            for key in keys:
                if hf_config.get(key) is not None:
                    return hf_config[key]
            return default

        hidden_size = int(get("hidden_size", "n_embed"))
        num_attention_heads = int(get("num_attention_heads", "n_head"))
        if hidden_size % num_attention_heads:
            raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_attention_heads={num_attention_heads}")
        new_arch = bool(hf_config.get("new_decoder_architecture", False))
        if new_arch:
            num_key_value_heads = int(get("num_kv_heads", "n_head_kv", default=num_attention_heads))
            # Falcon-40B/180B always run attention and MLP in parallel; 2 norms unless the config says 1.
            parallel_attn = True
            num_ln = int(get("num_ln_in_parallel_attn", default=2))
        else:
            # 7B-style: one K/V head when multi_query (the default), else one per query head.
            num_key_value_heads = 1 if hf_config.get("multi_query", True) else num_attention_heads
            parallel_attn = bool(hf_config.get("parallel_attn", True))
            num_ln = 1
        max_position_embeddings = int(hf_config.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling = _parse_rope(hf_config)
        bias = bool(hf_config.get("bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(hf_config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(get("ffn_hidden_size", default=4 * hidden_size)),
            num_hidden_layers=int(get("num_hidden_layers", "n_layer")),
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=hidden_size // num_attention_heads,
            rms_norm_eps=float(get("layer_norm_epsilon", default=1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", True)),
            attention_bias=bias,
            attention_out_bias=bias,
            qk_norm=False,
            sliding_window=None,
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf_config.get("eos_token_id")),
            torch_dtype=hf_config.get("dtype") or hf_config.get("torch_dtype"),
            hidden_act=activation,
            mlp_bias=bias,
            parallel_attn=parallel_attn,
            num_ln_in_parallel_attn=num_ln,
            new_decoder_architecture=new_arch,
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
