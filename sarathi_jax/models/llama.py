"""One Flax linen decoder for Llama 2/3/3.1, Mistral, Qwen2 and Qwen3, over a paged KV cache.

The families differ only by `ModelConfig` flags: q/k/v bias (Qwen2), o bias, per-head q/k RMSNorm (Qwen3),
tied LM head, llama3 RoPE scaling. Everything follows the Hugging Face PyTorch implementations (RoPE in the
rotate-half convention, RMSNorm weight times normalized input), so HF checkpoints load with reshapes and
concatenations only (`hf_param_plan`, at the end). The pieces Falcon shares (projections, RMSNorm, RoPE, the
paged self-attention and the decoder itself, `PagedDecoderLM`) are in `layers.py`; this module holds what is
Llama's own.

Parameter tree (kernels are `[in..., out...]`). The decoder layers run as one `nn.scan` (as MaxText's
`scan_layers`), so every layer parameter is stacked over a leading `layers` axis and the compiled step holds one
layer body whatever the depth. Each layer runs 4 weight matmuls: q, k and v are one (`qkv_proj`), gate and up
another (`gate_up_proj`), see `fusion.py`:

    embed_tokens                     [vocab, embed]
    layers/input_layernorm/scale     [layers, embed]
    layers/self_attn/qkv_proj/kernel [layers, embed, kv_heads, q_per_kv + 2, head_dim]  (+ bias: the same without embed)
    layers/self_attn/o_proj/kernel   [layers, heads, head_dim, embed]     (+ bias [layers, embed])
    layers/self_attn/{q,k}_norm/scale [layers, head_dim]                  (Qwen3)
    layers/post_attention_layernorm/scale [layers, embed]
    layers/mlp/gate_up_proj/kernel   [layers, embed, 2, mlp];  layers/mlp/down_proj/kernel [layers, mlp, embed]
    norm/scale                       [embed]
    lm_head                          [vocab, embed]                       (absent when tied)

Checkpoints keep HF's separate `q_proj`, `k_proj`, `v_proj` (`[layers, embed, heads or kv_heads, head_dim]`) and
`gate_proj`, `up_proj` (`[layers, embed, mlp]`): the checkpoint layout, which `hf_param_plan` maps and
`fusion.fuse_projections` joins once at load time.

With `scan_layers=False` the same layers are unrolled as `layers_{i}` entries without the leading axis (the
engine does this on GPU, where it runs faster: see `sarathi_jax.config.engine_config.resolve_scan_layers`);
`layers.stack_layer_params` / `layers.unstack_layer_params` convert between the two trees. Checkpoints and
presets are always stacked.

Every parameter carries logical axis names (`nn.with_logical_partitioning`); `models.param_logical_axes(config)`
returns the tree of logical `PartitionSpec`s, to be mapped onto a mesh with `nn.logical_to_mesh_sharding`.
Heads are an explicit kernel axis so tensor parallelism shards them without reshapes.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

from sarathi_jax.models.attention import AttentionMetadata, KVCache
from sarathi_jax.models.config import ModelConfig
from sarathi_jax.models.fusion import split_gate_up
from sarathi_jax.models.layers import PagedDecoderLayer, PagedDecoderLM, PagedSelfAttention, Projection, RMSNorm
from sarathi_jax.models.out_major import IN_MAJOR
from sarathi_jax.models.param_source import ParamSource


class MLP(nn.Module):
    """SwiGLU, `down(silu(gate(x)) * up(x))`, with gate and up in one matmul."""

    config: ModelConfig
    dtype: Any = jnp.float32
    projection_layout: str = IN_MAJOR  # how the projection weights are stored (`layers.Projection.layout`)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        embed, mlp = self.config.hidden_size, self.config.intermediate_size
        quantization = self.config.quantization
        gate_up = Projection((embed, 2, mlp), ("embed", "gate_up", "mlp"), dtype=self.dtype,
                             layout=self.projection_layout, quantization=quantization, name="gate_up_proj")(x)
        gate, up = split_gate_up(gate_up)  # [T, 2, mlp] -> [T, mlp] twice
        return Projection((mlp, embed), ("mlp", "embed"), dtype=self.dtype, layout=self.projection_layout,
                          quantization=quantization, name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(PagedDecoderLayer):
    """Pre-norm layer: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def block(
        self, x: jax.Array, kv_cache: KVCache, layer: jax.Array, cos: jax.Array, sin: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        c = self.config
        h = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", dtype=self.dtype, name="input_layernorm")(x)
        attn_out, kv_cache = PagedSelfAttention(c, self.attention_fn, dtype=self.dtype,
                                                projection_layout=self.projection_layout, name="self_attn")(
            h, cos, sin, kv_cache, layer, metadata
        )
        x = x + attn_out
        h = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", dtype=self.dtype, name="post_attention_layernorm")(x)
        x = x + MLP(c, dtype=self.dtype, projection_layout=self.projection_layout, name="mlp")(h)
        return x, kv_cache


class LlamaForCausalLM(PagedDecoderLM):
    """Decoder-only LM over a paged KV cache; see the module docstring, `layers.PagedDecoderLM` (fields, dtype
    rules) and docs/design/models.md (model contract)."""

    embedding_name: ClassVar[str] = "embed_tokens"
    layer_class: ClassVar[type[PagedDecoderLayer]] = DecoderLayer

    def final_norm(self) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps, "embed", dtype=self.dtype, name="norm")


# ---------------------------------------------------------------------------------------- HF checkpoints


def hf_param_plan(config: ModelConfig) -> Iterator[ParamSource]:
    """Where each parameter of the checkpoint layout (separate q/k/v and gate/up, see the module docstring) comes
    from in an HF Llama-family checkpoint (`model.*`, `lm_head`), in load order."""
    c = config
    embed, vocab, mlp = c.hidden_size, c.vocab_size, c.intermediate_size
    heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    P = ParamSource

    yield P(("embed_tokens",), "model.embed_tokens.weight", (vocab, embed), (vocab, embed))
    for i in range(c.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", "layers"
        P = functools.partial(ParamSource, layer=i)
        attn = hf + "self_attn."
        yield P((ours, "input_layernorm", "scale"), hf + "input_layernorm.weight", (embed,), (embed,))
        for proj, num_heads in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            yield P((ours, "self_attn", proj, "kernel"), f"{attn}{proj}.weight", (num_heads * head_dim, embed),
                    (embed, num_heads, head_dim), transpose=True)
            if c.attention_bias:
                yield P((ours, "self_attn", proj, "bias"), f"{attn}{proj}.bias", (num_heads * head_dim,),
                        (num_heads, head_dim))
        yield P((ours, "self_attn", "o_proj", "kernel"), attn + "o_proj.weight", (embed, heads * head_dim),
                (heads, head_dim, embed), transpose=True)
        if c.attention_out_bias:
            yield P((ours, "self_attn", "o_proj", "bias"), attn + "o_proj.bias", (embed,), (embed,))
        if c.qk_norm:
            yield P((ours, "self_attn", "q_norm", "scale"), attn + "q_norm.weight", (head_dim,), (head_dim,))
            yield P((ours, "self_attn", "k_norm", "scale"), attn + "k_norm.weight", (head_dim,), (head_dim,))
        yield P((ours, "post_attention_layernorm", "scale"), hf + "post_attention_layernorm.weight", (embed,), (embed,))
        yield P((ours, "mlp", "gate_proj", "kernel"), hf + "mlp.gate_proj.weight", (mlp, embed), (embed, mlp), True)
        yield P((ours, "mlp", "up_proj", "kernel"), hf + "mlp.up_proj.weight", (mlp, embed), (embed, mlp), True)
        yield P((ours, "mlp", "down_proj", "kernel"), hf + "mlp.down_proj.weight", (embed, mlp), (mlp, embed), True)
    P = ParamSource
    yield P(("norm", "scale"), "model.norm.weight", (embed,), (embed,))
    if not c.tie_word_embeddings:
        yield P(("lm_head",), "lm_head.weight", (vocab, embed), (vocab, embed))
