"""One Flax linen decoder for Llama 2/3/3.1, Mistral, Qwen2 and Qwen3, over a paged KV cache.

The families differ only by `ModelConfig` flags: q/k/v bias (Qwen2), o bias, per-head q/k RMSNorm (Qwen3),
tied LM head, llama3 RoPE scaling. Everything follows the Hugging Face PyTorch implementations (RoPE in the
rotate-half convention, RMSNorm weight times normalized input), so HF checkpoints load with reshapes only.

Parameter tree (HF names; kernels are `[in..., out...]`). The decoder layers run as one `nn.scan` (as
MaxText's `scan_layers`), so every layer parameter is stacked over a leading `layers` axis and the compiled
step holds one layer body whatever the depth:

    embed_tokens                     [vocab, embed]
    layers/input_layernorm/scale     [layers, embed]
    layers/self_attn/q_proj/kernel   [layers, embed, heads, head_dim]     (+ bias [layers, heads, head_dim])
    layers/self_attn/k_proj/kernel   [layers, embed, kv_heads, head_dim]  (+ bias)
    layers/self_attn/v_proj/kernel   [layers, embed, kv_heads, head_dim]  (+ bias)
    layers/self_attn/o_proj/kernel   [layers, heads, head_dim, embed]     (+ bias [layers, embed])
    layers/self_attn/{q,k}_norm/scale [layers, head_dim]                  (Qwen3)
    layers/post_attention_layernorm/scale [layers, embed]
    layers/mlp/{gate,up}_proj/kernel [layers, embed, mlp];  layers/mlp/down_proj/kernel [layers, mlp, embed]
    norm/scale                       [embed]
    lm_head                          [embed, vocab]                       (absent when tied)

With `scan_layers=False` the same layers are unrolled as `layers_{i}` entries without the leading axis (the
engine does this on GPU, where it runs faster: see `sarathi_jax.config.resolve_scan_layers`);
`stack_layer_params` / `unstack_layer_params` convert between the two trees. Checkpoints and presets are
always stacked.

Every parameter carries logical axis names (`nn.with_logical_partitioning`); `param_logical_axes(config)`
returns the tree of logical `PartitionSpec`s, to be mapped onto a mesh with `nn.logical_to_mesh_sharding`.
Heads are an explicit kernel axis so tensor parallelism shards them without reshapes.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_paged_attention_xla
from sarathi_jax.models.attention import AttentionMetadata, KVCache, init_kv_cache, layer_view, write_kv
from sarathi_jax.models.config import ModelConfig, RopeScaling

# Same signature as `ragged_paged_attention_xla` (see docs/design.md).
AttentionFn = Callable[..., jax.Array]

# Random-init scale of every matrix (HF `initializer_range`); gives logits of std ~0.3 at hidden 256.
INIT_STD = 0.02


def _weight_init(axes: tuple[str, ...]) -> Callable[..., Any]:
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=INIT_STD), axes)


def matmul_precision(dtype: Any) -> jax.lax.Precision:
    """float32 means float32: full-precision matmuls (a GPU's default for float32 is TF32, ~10 mantissa
    bits). bfloat16 keeps the default, which is the point of choosing it."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def rope_inv_freq(head_dim: int, rope_theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse RoPE frequencies `[head_dim // 2]`, computed in float32 exactly as transformers does."""
    dim = head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope_theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    # llama3 (Llama 3.1): leave high frequencies, divide low ones by `factor`, blend the band in between.
    old_context_len = np.float32(scaling.original_max_position_embeddings)
    low_freq_wavelen = old_context_len / np.float32(scaling.low_freq_factor)
    high_freq_wavelen = old_context_len / np.float32(scaling.high_freq_factor)
    factor = np.float32(scaling.factor)
    wavelen = np.float32(2 * np.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - np.float32(scaling.low_freq_factor)) / np.float32(
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on `x [T, heads, head_dim]` with `cos`/`sin` `[T, head_dim // 2]`, in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class RMSNorm(nn.Module):
    dim: int
    eps: float
    axis_name: str  # logical name of the normalized axis: "embed", or "head_dim" for q/k norm
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)), (self.dim,), self.dtype
        )
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * scale.astype(jnp.float32)).astype(self.dtype)


class Projection(nn.Module):
    """`tensordot(x, kernel)` over the last `num_contracting` axes of x, plus an optional bias."""

    kernel_shape: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    num_contracting: int = 1
    use_bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", _weight_init(self.kernel_axes), self.kernel_shape, self.dtype)
        y = jnp.tensordot(x.astype(self.dtype), kernel, axes=self.num_contracting,
                          precision=matmul_precision(self.dtype))
        if self.use_bias:
            out_shape = self.kernel_shape[self.num_contracting :]
            out_axes = self.kernel_axes[self.num_contracting :]
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, out_axes), out_shape, self.dtype)
            y = y + bias
        return y


class Attention(nn.Module):
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
        if c.qk_norm:
            q = RMSNorm(head_dim, c.rms_norm_eps, "head_dim", dtype=self.dtype, name="q_norm")(q)
            k = RMSNorm(head_dim, c.rms_norm_eps, "head_dim", dtype=self.dtype, name="k_norm")(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        k_pages, v_pages = write_kv(kv_cache[0], kv_cache[1], k, v, metadata.slot_mapping, layer)
        out = paged_attention(self.attention_fn, q, k_pages, v_pages, layer, metadata)
        out = Projection((heads, head_dim, embed), ("heads", "head_dim", "embed"), num_contracting=2,
                         use_bias=c.attention_out_bias, dtype=self.dtype, name="o_proj")(out)
        return out, (k_pages, v_pages)


class MLP(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        embed, mlp = self.config.hidden_size, self.config.intermediate_size
        gate = Projection((embed, mlp), ("embed", "mlp"), dtype=self.dtype, name="gate_proj")(x)
        up = Projection((embed, mlp), ("embed", "mlp"), dtype=self.dtype, name="up_proj")(x)
        return Projection((mlp, embed), ("mlp", "embed"), dtype=self.dtype, name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One layer, in scan form: `((x [T, embed], kv_cache), layer, cos, sin, metadata) -> ((x, kv_cache), None)`,
    `layer` the index of this layer in the stacked KV cache."""

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
        h = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", dtype=self.dtype, name="input_layernorm")(x)
        attn_out, kv_cache = Attention(c, self.attention_fn, dtype=self.dtype, name="self_attn")(
            h, cos, sin, kv_cache, layer, metadata
        )
        x = x + attn_out
        h = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", dtype=self.dtype, name="post_attention_layernorm")(x)
        x = x + MLP(c, dtype=self.dtype, name="mlp")(h)
        return (x, kv_cache), None


def paged_attention(attention_fn: AttentionFn, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    layer: jax.Array, metadata: AttentionMetadata) -> jax.Array:
    """`attention_fn` over layer `layer` of the stacked cache (see `attention.layer_view`)."""
    k_view, block_tables = layer_view(k_pages, metadata.block_tables, layer)
    v_view, _ = layer_view(v_pages, metadata.block_tables, layer)
    return attention_fn(
        q, k_view, v_view, metadata.kv_lens, block_tables, metadata.cu_q_lens, metadata.num_seqs,
        sm_scale=q.shape[-1] ** -0.5,
    )


def paged_decoder_forward(
    module: nn.Module,
    token_ids: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    logits_indices: jax.Array,
    *,
    embedding_name: str,
    layer_class: type[nn.Module],
    make_final_norm: Callable[[], nn.Module],
) -> tuple[jax.Array, KVCache]:
    """The body every decoder here shares, called from its compact `__call__`: token embedding, the layers
    over the stacked paged KV cache, then the final norm and LM head on the `logits_indices` rows only.

    `layer_class(config, attention_fn, dtype)` is one layer in scan form (see `DecoderLayer`). With
    `module.scan_layers` the layers are one `nn.scan` over parameters stacked on a leading "layers" axis:
    the compiled step holds one layer body, so compile time does not grow with depth. Otherwise they are
    unrolled (`layers_{i}`), for tests and debugging.

    Honours `module.layer_range` (pipeline stages): the stage's `layers` parameters and KV cache hold only
    its layers; a stage with start > 0 takes hidden states `[T, embed]` in place of `token_ids`; a stage that
    does not end the model returns `(hidden states, kv_cache)`.
    """
    c: ModelConfig = module.config
    start, end = module.layer_range or (0, c.num_hidden_layers)
    if not 0 <= start < end <= c.num_hidden_layers:
        raise ValueError(f"layer_range {module.layer_range} is not a non-empty range of {c.num_hidden_layers} layers")
    num_layers = end - start
    if kv_cache[0].ndim != 5 or kv_cache[0].shape[0] != num_layers:
        raise ValueError(f"KV cache of shape {kv_cache[0].shape} is not [{num_layers}, blocks, block_size, kv_heads, "
                         "head_dim] for this model's layers")
    is_last = end == c.num_hidden_layers
    if start == 0 or (is_last and c.tie_word_embeddings):
        embedding = module.param(
            embedding_name, _weight_init(("vocab", "embed")), (c.vocab_size, c.hidden_size), module.dtype
        )
    x = jnp.take(embedding, token_ids, axis=0) if start == 0 else token_ids  # [T, embed]

    # RoPE angles once per step, shared by all layers.
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # [T, head_dim // 2]

    layer_args = (c, module.attention_fn, module.dtype)
    if module.scan_layers:
        layers = nn.scan(
            layer_class,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},  # logical axis name of the stacked axis
        )(*layer_args, name="layers")
        (x, kv_cache), _ = layers((x, kv_cache), jnp.arange(num_layers, dtype=jnp.int32), cos, sin, metadata)
    else:
        for i in range(num_layers):  # global layer names; layer i of this stage's KV cache
            (x, kv_cache), _ = layer_class(*layer_args, name=f"layers_{start + i}")(
                (x, kv_cache), jnp.int32(i), cos, sin, metadata
            )
    if not is_last:
        return x, kv_cache

    # Only the rows that sample go through the final norm and the LM head.
    h = make_final_norm()(x[logits_indices])  # [S, embed]
    precision = matmul_precision(module.dtype)
    if c.tie_word_embeddings:
        logits = jnp.einsum("se,ve->sv", h, embedding, precision=precision, preferred_element_type=jnp.float32)
    else:
        lm_head = module.param(
            "lm_head", _weight_init(("embed", "vocab")), (c.hidden_size, c.vocab_size), module.dtype
        )
        logits = jnp.einsum("se,ev->sv", h, lm_head, precision=precision, preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32), kv_cache  # [S, vocab]


def stack_layer_params(params: Any, num_layers: int, first_layer: int = 0) -> Any:
    """Unrolled params (`layers_{i}` entries, i from `first_layer`) -> scanned params (one `layers` entry,
    stacked on axis 0)."""
    per_layer = [params[f"layers_{first_layer + i}"] for i in range(num_layers)]
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
    return out


def unstack_layer_params(params: Any, first_layer: int = 0) -> Any:
    """Scanned params -> unrolled params (`layers_{first_layer + i}` entries; a pipeline stage's layers keep
    their global names), the inverse of `stack_layer_params`. Each layer's slice is a new array: the layer
    weights are held twice until the stacked ones are dropped."""
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        out[f"layers_{first_layer + i}"] = jax.tree.map(lambda x: x[i], stacked)
    return out


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM over a paged KV cache; see the module docstring and docs/design.md (model contract).

    `dtype` is both the parameter and the activation dtype; norms, RoPE, attention softmax and the logits
    are computed in float32 whatever it is, and float32 matmuls run at full precision (`matmul_precision`).
    """

    config: ModelConfig
    dtype: Any = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention_xla
    # Pipeline-stage hook (None: the whole model). `(start, end)` runs layers start..end-1 only: the stacked
    # `layers` params and the KV cache then hold those layers only. A stage with start > 0 takes hidden
    # states `[T, embed]` in place of `token_ids`; a stage with end < num_hidden_layers returns
    # `(hidden states, kv_cache)` instead of logits.
    layer_range: tuple[int, int] | None = None
    # One `nn.scan` over stacked layer params (the serving default); False unrolls them (`layers_{i}`).
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
            embedding_name="embed_tokens",
            layer_class=DecoderLayer,
            make_final_norm=lambda: RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", dtype=self.dtype, name="norm"),
        )


def get_model(config: ModelConfig, dtype: Any = jnp.float32, attention_fn: AttentionFn | None = None) -> LlamaForCausalLM:
    """The Flax module for `config`; `attention_fn` picks the attention backend (default: the jnp one)."""
    return LlamaForCausalLM(
        config=config, dtype=jnp.dtype(dtype), attention_fn=attention_fn or ragged_paged_attention_xla
    )


def dummy_inputs(config: ModelConfig, dtype: Any = jnp.float32) -> tuple[Any, ...]:
    """Smallest valid `(token_ids, positions, kv_cache, metadata, logits_indices)`, for `init`/`eval_shape`."""
    metadata = AttentionMetadata(
        slot_mapping=jnp.zeros((1,), jnp.int32),
        kv_lens=jnp.ones((1,), jnp.int32),
        block_tables=jnp.zeros((1, 1), jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        num_seqs=jnp.ones((1,), jnp.int32),
    )
    kv_cache = init_kv_cache(config, num_blocks=1, block_size=1, dtype=dtype)
    token_ids = jnp.zeros((1,), jnp.int32)
    return token_ids, jnp.zeros((1,), jnp.int32), kv_cache, metadata, jnp.zeros((1,), jnp.int32)


def _boxed_param_shapes(config: ModelConfig, dtype: Any) -> Any:
    model = get_model(config, dtype)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), *dummy_inputs(config, dtype)))["params"]


def param_logical_axes(config: ModelConfig) -> Any:
    """Tree (same structure as the params) of `PartitionSpec`s of logical axis names, e.g.
    `PartitionSpec("layers", "embed", "heads", "head_dim")` for layers/self_attn/q_proj/kernel. Map to a mesh with
    `nn.logical_to_mesh_sharding(param_logical_axes(config), mesh, rules)`."""
    return nn.get_partition_spec(_boxed_param_shapes(config, jnp.float32))


def param_shapes(config: ModelConfig, dtype: Any = jnp.float32) -> Any:
    """Tree of `jax.ShapeDtypeStruct` of the (unboxed) params."""
    return nn.meta.unbox(_boxed_param_shapes(config, jnp.dtype(dtype)))
