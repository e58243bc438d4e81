"""Falcon (`FalconForCausalLM`, the Falcon-7B/40B/180B family) as a Flax linen decoder over the paged KV cache.

Same model contract as `llama.py` (see docs/design/models.md), built from the same shared layers (`layers.py`: the
projections, RoPE, `PagedSelfAttention` over the paged KV cache with its pluggable `attention_fn`, and the
decoder itself, `PagedDecoderLM`): the same `__call__` signature, logits only for `logits_indices`,
logical axis names on every parameter. Follows transformers' `modeling_falcon.py`:

  * LayerNorm (scale and bias) everywhere, GELU MLP (`dense_h_to_4h` -> GELU -> `dense_4h_to_h`), optional
    bias on every matrix (`bias`), rotary embeddings in the rotate-half convention.
  * `parallel_attn`: attention and MLP both read the layer input, `x + (mlp + attn)`. The new decoder
    architecture (40B/180B) normalizes separately for each (`ln_attn`, `ln_mlp`) unless
    `num_ln_in_parallel_attn == 1`; the 7B style shares one `input_layernorm`. `parallel_attn=False` is the
    sequential pre-norm layer (`input_layernorm`, `post_attention_layernorm`).
  * Multi-query (7B: one K/V head) or grouped-query (40B/180B: `num_kv_heads`) attention. HF fuses q, k and v
    in one `query_key_value` matrix whose row layout depends on the variant; `hf_param_plan` (at the end)
    splits it into the checkpoint layout's `q_proj` / `k_proj` / `v_proj` (`falcon_qkv_rows`), as for Llama,
    and `fusion.fuse_projections` joins them at load time into `qkv_proj`, grouped per KV head (the layout of
    every variant's `query_key_value` once multi-query is read as 1 KV head and the old interleaved one as
    `heads` KV heads), so tensor parallelism shards KV heads without reshapes.
  * ALiBi Falcon (`alibi=True`) is rejected when the config is parsed.

Parameter tree (kernels are `[in..., out...]`; `bias` entries only with the `bias` flag). As in `llama.py`
the layers are one `nn.scan`: every `layers/...` leaf has a leading `[layers]` axis, omitted below. A layer
runs 4 weight matmuls (fused q/k/v, dense, and the two of the MLP, which has no gate).

    word_embeddings                                  [vocab, embed]
    layers/ln_attn/{scale,bias}, ln_mlp/{scale,bias} [embed]        (new decoder architecture, 2 norms)
    layers/input_layernorm/{scale,bias}              [embed]        (otherwise)
    layers/post_attention_layernorm/{scale,bias}     [embed]        (parallel_attn=False)
    layers/self_attention/qkv_proj/kernel            [embed, kv_heads, q_per_kv + 2, head_dim]
                                                     (+ bias [kv_heads, q_per_kv + 2, head_dim])
    layers/self_attention/dense/kernel               [heads, head_dim, embed]     (+ bias [embed])
    layers/mlp/dense_h_to_4h/kernel                  [embed, mlp]   (+ bias [mlp])
    layers/mlp/dense_4h_to_h/kernel                  [mlp, embed]   (+ bias [embed])
    ln_f/{scale,bias}                                [embed]
    lm_head                                          [vocab, embed] (absent when tied, the Falcon default)
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

from sarathi_jax.models.attention import AttentionMetadata, KVCache
from sarathi_jax.models.config import ModelConfig
from sarathi_jax.models.layers import PagedDecoderLayer, PagedDecoderLM, PagedSelfAttention, Projection
from sarathi_jax.models.out_major import IN_MAJOR
from sarathi_jax.models.param_source import ParamSource


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


class FalconMLP(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32
    projection_layout: str = IN_MAJOR  # how the projection weights are stored (`layers.Projection.layout`)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        h = Projection((c.hidden_size, c.intermediate_size), ("embed", "mlp"), use_bias=c.mlp_bias,
                       dtype=self.dtype, layout=self.projection_layout, quantization=c.quantization,
                       name="dense_h_to_4h")(x)
        h = gelu(h, c.hidden_act)
        return Projection((c.intermediate_size, c.hidden_size), ("mlp", "embed"), use_bias=c.mlp_bias,
                          dtype=self.dtype, layout=self.projection_layout, quantization=c.quantization,
                          name="dense_4h_to_h")(h)


class FalconDecoderLayer(PagedDecoderLayer):
    """Parallel (`x + (mlp + attn)`) or sequential pre-norm layer; see the module docstring."""

    def block(
        self, x: jax.Array, kv_cache: KVCache, layer: jax.Array, cos: jax.Array, sin: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        c = self.config

        def norm(name: str) -> LayerNorm:
            return LayerNorm(c.hidden_size, c.rms_norm_eps, dtype=self.dtype, name=name)

        attention = PagedSelfAttention(c, self.attention_fn, dtype=self.dtype, out_proj_name="dense",
                                       projection_layout=self.projection_layout, name="self_attention")
        mlp = FalconMLP(c, dtype=self.dtype, projection_layout=self.projection_layout, name="mlp")
        if c.parallel_attn:
            if c.num_ln_in_parallel_attn == 2:
                attn_in, mlp_in = norm("ln_attn")(x), norm("ln_mlp")(x)
            else:
                attn_in = mlp_in = norm("input_layernorm")(x)
            attn_out, kv_cache = attention(attn_in, cos, sin, kv_cache, layer, metadata)
            # HF: mlp_output += attention_output; output = residual + mlp_output.
            return x + (mlp(mlp_in) + attn_out), kv_cache
        attn_out, kv_cache = attention(norm("input_layernorm")(x), cos, sin, kv_cache, layer, metadata)
        x = x + attn_out
        return x + mlp(norm("post_attention_layernorm")(x)), kv_cache


class FalconForCausalLM(PagedDecoderLM):
    """Falcon decoder over a paged KV cache; same contract, fields and dtype rules as `LlamaForCausalLM`
    (`layers.PagedDecoderLM`)."""

    embedding_name: ClassVar[str] = "word_embeddings"
    layer_class: ClassVar[type[PagedDecoderLayer]] = FalconDecoderLayer

    def final_norm(self) -> nn.Module:
        return LayerNorm(self.config.hidden_size, self.config.rms_norm_eps, dtype=self.dtype, name="ln_f")


# ---------------------------------------------------------------------------------------- HF checkpoints


def falcon_qkv_rows(config: ModelConfig) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Row ranges of q, k and v in Falcon's fused `query_key_value` weight (and bias).

    transformers' `FalconAttention._split_heads` views the fused output as `[kv_heads, q_per_kv + 2, head_dim]`
    for the new decoder architecture (each K/V group: its q heads, then k, then v), as `[heads + 2, head_dim]`
    for multi-query (all q heads, then the one k, then v) and as `[heads, 3, head_dim]` otherwise (q, k, v per
    head). With `num_key_value_heads` = kv_heads, 1 and heads respectively, all three are the grouped layout.
    """
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_kv = heads // kv_heads
    group = (per_kv + 2) * head_dim
    q, k, v = [], [], []
    for g in range(kv_heads):
        base = g * group
        q.append((base, base + per_kv * head_dim))
        k.append((base + per_kv * head_dim, base + (per_kv + 1) * head_dim))
        v.append((base + (per_kv + 1) * head_dim, base + group))

    def merged(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        out = [ranges[0]]
        for start, stop in ranges[1:]:
            if start == out[-1][1]:
                out[-1] = (out[-1][0], stop)
            else:
                out.append((start, stop))
        return tuple(out)

    return merged(q), merged(k), merged(v)


def hf_param_plan(config: ModelConfig) -> Iterator[ParamSource]:
    """Where each parameter of the checkpoint layout (separate q/k/v, see the module docstring) comes from in an
    HF Falcon checkpoint (`transformer.*`, `lm_head`), in load order."""
    c = config
    embed, vocab, mlp = c.hidden_size, c.vocab_size, c.intermediate_size
    heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    P = ParamSource
    qkv_rows = (heads + 2 * kv_heads) * head_dim
    q_rows, k_rows, v_rows = falcon_qkv_rows(c)

    yield P(("word_embeddings",), "transformer.word_embeddings.weight", (vocab, embed), (vocab, embed))
    for i in range(c.num_hidden_layers):
        hf, ours = f"transformer.h.{i}.", "layers"
        P = functools.partial(ParamSource, layer=i)
        if c.parallel_attn:
            norms = ("ln_attn", "ln_mlp") if c.num_ln_in_parallel_attn == 2 else ("input_layernorm",)
        else:
            norms = ("input_layernorm", "post_attention_layernorm")
        for norm in norms:
            yield P((ours, norm, "scale"), f"{hf}{norm}.weight", (embed,), (embed,))
            yield P((ours, norm, "bias"), f"{hf}{norm}.bias", (embed,), (embed,))
        attn = hf + "self_attention."
        for proj, rows, num_heads in (("q_proj", q_rows, heads), ("k_proj", k_rows, kv_heads),
                                      ("v_proj", v_rows, kv_heads)):
            yield P((ours, "self_attention", proj, "kernel"), attn + "query_key_value.weight", (qkv_rows, embed),
                    (embed, num_heads, head_dim), transpose=True, rows=rows)
            if c.attention_bias:
                yield P((ours, "self_attention", proj, "bias"), attn + "query_key_value.bias", (qkv_rows,),
                        (num_heads, head_dim), rows=rows)
        yield P((ours, "self_attention", "dense", "kernel"), attn + "dense.weight", (embed, heads * head_dim),
                (heads, head_dim, embed), transpose=True)
        if c.attention_out_bias:
            yield P((ours, "self_attention", "dense", "bias"), attn + "dense.bias", (embed,), (embed,))
        yield P((ours, "mlp", "dense_h_to_4h", "kernel"), hf + "mlp.dense_h_to_4h.weight", (mlp, embed), (embed, mlp),
                transpose=True)
        if c.mlp_bias:
            yield P((ours, "mlp", "dense_h_to_4h", "bias"), hf + "mlp.dense_h_to_4h.bias", (mlp,), (mlp,))
        yield P((ours, "mlp", "dense_4h_to_h", "kernel"), hf + "mlp.dense_4h_to_h.weight", (embed, mlp), (mlp, embed),
                transpose=True)
        if c.mlp_bias:
            yield P((ours, "mlp", "dense_4h_to_h", "bias"), hf + "mlp.dense_4h_to_h.bias", (embed,), (embed,))
    P = ParamSource
    yield P(("ln_f", "scale"), "transformer.ln_f.weight", (embed,), (embed,))
    yield P(("ln_f", "bias"), "transformer.ln_f.bias", (embed,), (embed,))
    if not c.tie_word_embeddings:
        yield P(("lm_head",), "lm_head.weight", (vocab, embed), (vocab, embed))
