"""Falcon (`FalconForCausalLM`, the Falcon-7B/40B/180B family) as a Flax linen decoder over the paged KV cache.

Same model contract as `llama.py` (see docs/design.md): the same `__call__` signature, K/V written with
`write_kv` and read by the pluggable `attention_fn`, logits only for `logits_indices`, logical axis names on
every parameter. Follows transformers' `modeling_falcon.py`:

  * LayerNorm (scale and bias) everywhere, GELU MLP (`dense_h_to_4h` -> GELU -> `dense_4h_to_h`), optional
    bias on every matrix (`bias`), rotary embeddings in the rotate-half convention.
  * `parallel_attn`: attention and MLP both read the layer input, `x + (mlp + attn)`. The new decoder
    architecture (40B/180B) normalizes separately for each (`ln_attn`, `ln_mlp`) unless
    `num_ln_in_parallel_attn == 1`; the 7B style shares one `input_layernorm`. `parallel_attn=False` is the
    sequential pre-norm layer (`input_layernorm`, `post_attention_layernorm`).
  * Multi-query (7B: one K/V head) or grouped-query (40B/180B: `num_kv_heads`) attention. HF fuses q, k and v
    in one `query_key_value` matrix whose row layout depends on the variant; the loader splits it into the
    `q_proj` / `k_proj` / `v_proj` kernels below (see `loader.falcon_plan`), so the model itself is layout-free
    and tensor parallelism can shard heads without reshapes.
  * ALiBi Falcon (`alibi=True`) is rejected when the config is parsed.

Parameter tree (kernels are `[in..., out...]`; `bias` entries only with the `bias` flag). As in `llama.py`
the layers are one `nn.scan`: every `layers/...` leaf has a leading `[layers]` axis, omitted below.

    word_embeddings                                  [vocab, embed]
    layers/ln_attn/{scale,bias}, ln_mlp/{scale,bias} [embed]        (new decoder architecture, 2 norms)
    layers/input_layernorm/{scale,bias}              [embed]        (otherwise)
    layers/post_attention_layernorm/{scale,bias}     [embed]        (parallel_attn=False)
    layers/self_attention/q_proj/kernel              [embed, heads, head_dim]     (+ bias [heads, head_dim])
    layers/self_attention/{k,v}_proj/kernel          [embed, kv_heads, head_dim]  (+ bias)
    layers/self_attention/dense/kernel               [heads, head_dim, embed]     (+ bias [embed])
    layers/mlp/dense_h_to_4h/kernel                  [embed, mlp]   (+ bias [mlp])
    layers/mlp/dense_4h_to_h/kernel                  [mlp, embed]   (+ bias [embed])
    ln_f/{scale,bias}                                [embed]
    lm_head                                          [embed, vocab] (absent when tied, the Falcon default)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_kernels import ragged_paged_attention_xla
from sarathi_jax.models.attention import AttentionMetadata, KVCache, write_kv
from sarathi_jax.models.config import FALCON_ARCHITECTURES, ModelConfig
from sarathi_jax.models.llama import (
    AttentionFn,
    Projection,
    apply_rope,
    dummy_inputs,
    paged_attention,
    paged_decoder_forward,
)

ARCHITECTURES = FALCON_ARCHITECTURES


class LayerNorm(nn.Module):
    """torch.nn.LayerNorm over the last axis (biased variance), computed in float32."""

    dim: int
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (self.dim,),
                           self.dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), (self.dim,),
                          self.dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        centered = x32 - mean
        var = jnp.mean(centered * centered, axis=-1, keepdims=True)
        normed = centered * jax.lax.rsqrt(var + self.eps)
        return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


def gelu(x: jax.Array, hidden_act: str) -> jax.Array:
    """HF's "gelu" is the exact (erf) GELU; "gelu_new" / "gelu_pytorch_tanh" the tanh approximation."""
    return jax.nn.gelu(x, approximate=hidden_act != "gelu")


class FalconAttention(nn.Module):
    config: ModelConfig
    attention_fn: AttentionFn
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, kv_cache: KVCache, layer: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        c = self.config
        embed, heads, kv_heads, head_dim = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = Projection((embed, heads, head_dim), ("embed", "heads", "head_dim"),
                       use_bias=c.attention_bias, dtype=self.dtype, name="q_proj")(x)
        k = Projection((embed, kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                       use_bias=c.attention_bias, dtype=self.dtype, name="k_proj")(x)
        v = Projection((embed, kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                       use_bias=c.attention_bias, dtype=self.dtype, name="v_proj")(x)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_pages, v_pages = write_kv(kv_cache[0], kv_cache[1], k, v, metadata.slot_mapping, layer)
        # Query head h reads K/V head h // (heads // kv_heads): HF's grouped layout (and MQA's single head).
        out = paged_attention(self.attention_fn, q, k_pages, v_pages, layer, metadata)
        out = Projection((heads, head_dim, embed), ("heads", "head_dim", "embed"), num_contracting=2,
                         use_bias=c.attention_out_bias, dtype=self.dtype, name="dense")(out)
        return out, (k_pages, v_pages)


class FalconMLP(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        h = Projection((c.hidden_size, c.intermediate_size), ("embed", "mlp"), use_bias=c.mlp_bias,
                       dtype=self.dtype, name="dense_h_to_4h")(x)
        h = gelu(h, c.hidden_act)
        return Projection((c.intermediate_size, c.hidden_size), ("mlp", "embed"), use_bias=c.mlp_bias,
                          dtype=self.dtype, name="dense_4h_to_h")(h)


class FalconDecoderLayer(nn.Module):
    """One layer in scan form, as `llama.DecoderLayer`."""

    config: ModelConfig
    attention_fn: AttentionFn
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, carry: tuple[jax.Array, KVCache], layer: jax.Array, cos: jax.Array, sin: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[tuple[jax.Array, KVCache], None]:
        c = self.config
        x, kv_cache = carry

        def norm(name: str) -> LayerNorm:
            return LayerNorm(c.hidden_size, c.rms_norm_eps, dtype=self.dtype, name=name)

        attention = FalconAttention(c, self.attention_fn, dtype=self.dtype, name="self_attention")
        mlp = FalconMLP(c, dtype=self.dtype, name="mlp")
        if c.parallel_attn:
            if c.num_ln_in_parallel_attn == 2:
                attn_in, mlp_in = norm("ln_attn")(x), norm("ln_mlp")(x)
            else:
                attn_in = mlp_in = norm("input_layernorm")(x)
            attn_out, kv_cache = attention(attn_in, cos, sin, kv_cache, layer, metadata)
            # HF: mlp_output += attention_output; output = residual + mlp_output.
            return (x + (mlp(mlp_in) + attn_out), kv_cache), None
        attn_out, kv_cache = attention(norm("input_layernorm")(x), cos, sin, kv_cache, layer, metadata)
        x = x + attn_out
        return (x + mlp(norm("post_attention_layernorm")(x)), kv_cache), None


class FalconForCausalLM(nn.Module):
    """Falcon decoder over a paged KV cache; same contract and dtype rules as `LlamaForCausalLM`."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention_xla
    # Pipeline-stage hook and layer scan, as `LlamaForCausalLM.layer_range` / `scan_layers`.
    layer_range: tuple[int, int] | None = None
    scan_layers: bool = True

    @nn.compact
    def __call__(
        self,
        token_ids: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        logits_indices: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        c = self.config
        return paged_decoder_forward(
            self, token_ids, positions, kv_cache, metadata, logits_indices,
            embedding_name="word_embeddings",
            layer_class=FalconDecoderLayer,
            make_final_norm=lambda: LayerNorm(c.hidden_size, c.rms_norm_eps, dtype=self.dtype, name="ln_f"),
        )


def get_model(config: ModelConfig, dtype: Any = jnp.float32, attention_fn: AttentionFn | None = None) -> FalconForCausalLM:
    return FalconForCausalLM(
        config=config, dtype=jnp.dtype(dtype), attention_fn=attention_fn or ragged_paged_attention_xla
    )


def _boxed_param_shapes(config: ModelConfig, dtype: Any) -> Any:
    model = get_model(config, dtype)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), *dummy_inputs(config, dtype)))["params"]


def param_logical_axes(config: ModelConfig) -> Any:
    """Tree of logical `PartitionSpec`s, as `llama.param_logical_axes`."""
    return nn.get_partition_spec(_boxed_param_shapes(config, jnp.float32))


def param_shapes(config: ModelConfig, dtype: Any = jnp.float32) -> Any:
    """Tree of `jax.ShapeDtypeStruct` of the (unboxed) params."""
    return nn.meta.unbox(_boxed_param_shapes(config, jnp.dtype(dtype)))
