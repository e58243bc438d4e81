"""The layers every decoder here shares: projections, RMSNorm, RoPE, paged self-attention (q, k and v from one
fused projection, see `fusion.py`) and the paged decoder itself (`PagedDecoderLM`: embedding, the layer scan
over the stacked KV cache, final norm, LM head).

`llama.py` and `falcon.py` build their layers from these and differ only where the architectures do (norms,
MLP, residual layout, parameter names). Every parameter carries logical axis names
(`nn.with_logical_partitioning`); heads are an explicit kernel axis so tensor parallelism shards them without
reshapes. Kernels are `[in..., out...]`.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_paged_attention_xla
from sarathi_jax.models.attention import AttentionMetadata, KVCache, layer_view, write_kv
from sarathi_jax.models.config import ModelConfig, RopeScaling
from sarathi_jax.models.fusion import split_qkv
from sarathi_jax.models.quantization import KERNEL_SCALE, storage_dtype
from sarathi_jax.models.out_major import IN_MAJOR, OUT_MAJOR, PANELS, out_major_product, panel_product, panel_shape

# Same signature as `ragged_paged_attention_xla` (the attention contract: docs/design/kernels.md).
AttentionFn = Callable[..., jax.Array]

# Random-init scale of every matrix (HF `initializer_range`); gives logits of std ~0.3 at hidden 256.
INIT_STD = 0.02


def weight_init(axes: tuple[str, ...]) -> Callable[..., Any]:
    """Normal(`INIT_STD`) initializer of a matrix whose axes have the logical names `axes`."""
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=INIT_STD), axes)


def quantized_init(axes: tuple[str, ...]) -> Callable[..., Any]:
    """Zeros initializer of an 8-bit kernel with logical axes `axes` (its shapes and axes are what `init`
    describes; quantized values come from the loaders, `quantization.py`)."""
    return nn.with_logical_partitioning(nn.initializers.zeros, axes)


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


def materialized(x: jax.Array) -> jax.Array:
    """`x [T, N]` float32, the same values, computed once into a buffer of its own.

    XLA fuses an elementwise producer into each of its consumers, and a loop fusion evaluates it per output
    element: the RoPE cos/sin of a step, read by every layer's q and k rotation and broadcast over the heads,
    were evaluated heads x layers x 2 times over (on a CPU 9 of 180 ms of a 512-token step of the 60M Llama, by
    `benchmarks.probes.trace_summary` of a traced step). `optimization_barrier` does not stop it (XLA:CPU expands
    barriers before fusion); a dot with the identity does: it is its own (matmul) op, and exact in float32
    (x * 1 + 0s) but for subnormals, which flush to zero (no cos or sin of a RoPE angle is one)."""
    eye = jnp.eye(x.shape[-1], dtype=x.dtype)
    return jnp.dot(x, eye, precision=jax.lax.Precision.HIGHEST)


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
    """`tensordot(x, kernel)` over the last `num_contracting` axes of x, plus an optional bias.

    `kernel_shape` and `kernel_axes` are `[in..., out...]`. `layout` (`out_major.py` says why and when) stores the
    parameter that way (`IN_MAJOR`), `[out..., in...]` (`OUT_MAJOR`, HF's own layout; the product is
    `out_major_product`) or packed into column panels `[ceil(out / 64), in, 64]` (`PANELS`, float32 or int8; the
    product is the C++ `panel_product`): the same sums in another order.

    `quantization` (`quantization.py`): the kernel is stored int8 or float8_e4m3fn with a float32 `kernel_scale
    [out...]` beside it (logical axes: the output axes), and the product is `(x . q) * kernel_scale`, q widened to
    the activation dtype and the sum kept in float32."""

    kernel_shape: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    num_contracting: int = 1
    use_bias: bool = False
    dtype: Any = jnp.float32
    layout: str = IN_MAJOR
    quantization: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        nc, quantized = self.num_contracting, self.quantization is not None
        in_shape, out_shape = self.kernel_shape[:nc], self.kernel_shape[nc:]
        stored = storage_dtype(self.quantization, self.dtype)
        init = weight_init if not quantized else quantized_init
        if self.layout == PANELS:
            panels = self.param("kernel", init((None, None, None)), panel_shape(out_shape, in_shape), stored)
            y = panel_product(x, panels, out_shape, nc, self._scale(out_shape) if quantized else None)
            return self._bias(y.astype(self.dtype), out_shape)
        if self.layout == OUT_MAJOR:
            kernel = self.param("kernel", init(self.kernel_axes[nc:] + self.kernel_axes[:nc]), out_shape + in_shape,
                                stored)
            y = out_major_product(x.astype(self.dtype), kernel.astype(self.dtype), nc, matmul_precision(self.dtype),
                                  jnp.float32 if quantized else None)
        else:
            kernel = self.param("kernel", init(self.kernel_axes), self.kernel_shape, stored)
            y = jnp.tensordot(x.astype(self.dtype), kernel.astype(self.dtype), axes=nc,
                              precision=matmul_precision(self.dtype),
                              preferred_element_type=jnp.float32 if quantized else None)
        if quantized:
            y = (y * self._scale(out_shape)).astype(self.dtype)
        return self._bias(y, out_shape)

    def _scale(self, out_shape: tuple[int, ...]) -> jax.Array:
        """The float32 per-output-channel scales `[out...]` of a quantized kernel."""
        axes = self.kernel_axes[self.num_contracting :]
        return self.param(KERNEL_SCALE, nn.with_logical_partitioning(nn.initializers.ones, axes), out_shape,
                          jnp.float32)

    def _bias(self, y: jax.Array, out_shape: tuple[int, ...]) -> jax.Array:
        if not self.use_bias:
            return y
        out_axes = self.kernel_axes[self.num_contracting :]
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, out_axes), out_shape, self.dtype)
        return y + bias


class PagedSelfAttention(nn.Module):
    """Self-attention over the paged KV cache: the fused q/k/v projection (`qkv_proj`, see `fusion.py`), the
    optional per-head q/k RMSNorm (`q_norm`, `k_norm`, with `config.qk_norm`), RoPE, the cache write,
    `attention_fn` and the output projection (named `out_proj_name`: Llama's `o_proj`, Falcon's `dense`).

    `x [T, embed]` -> `[T, embed]`. Query head h reads K/V head h // (heads // kv_heads): HF's grouped layout
    (and multi-query's single head)."""

    config: ModelConfig
    attention_fn: AttentionFn
    dtype: Any = jnp.float32
    out_proj_name: str = "o_proj"
    projection_layout: str = IN_MAJOR  # how the projection weights are stored (`Projection.layout`)

    @nn.compact
    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, kv_cache: KVCache, layer: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        c = self.config
        embed, heads, kv_heads, head_dim = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # One matmul for q, k and v: [T, kv_heads, q_per_kv + 2, head_dim], each KV head's query heads beside it.
        slots = heads // kv_heads + 2
        qkv = Projection((embed, kv_heads, slots, head_dim), ("embed", "kv_heads", "qkv", "head_dim"),
                         use_bias=c.attention_bias, dtype=self.dtype, layout=self.projection_layout,
                         quantization=c.quantization, name="qkv_proj")(x)
        q, k, v = split_qkv(qkv)  # [T, heads, head_dim], [T, kv_heads, head_dim] twice
        if c.qk_norm:
            q = RMSNorm(head_dim, c.rms_norm_eps, "head_dim", dtype=self.dtype, name="q_norm")(q)
            k = RMSNorm(head_dim, c.rms_norm_eps, "head_dim", dtype=self.dtype, name="k_norm")(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        k_pages, v_pages = write_kv(kv_cache[0], kv_cache[1], k, v, metadata.slot_mapping, layer)
        out = paged_attention(self.attention_fn, q, k_pages, v_pages, layer, metadata)
        out = Projection((heads, head_dim, embed), ("heads", "head_dim", "embed"), num_contracting=2,
                         use_bias=c.attention_out_bias, dtype=self.dtype, layout=self.projection_layout,
                         quantization=c.quantization, name=self.out_proj_name)(out)
        return out, (k_pages, v_pages)


def paged_attention(attention_fn: AttentionFn, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    layer: jax.Array, metadata: AttentionMetadata) -> jax.Array:
    """`attention_fn` over layer `layer` of the stacked cache (see `attention.layer_view`)."""
    k_view, block_tables = layer_view(k_pages, metadata.block_tables, layer)
    v_view, _ = layer_view(v_pages, metadata.block_tables, layer)
    return attention_fn(
        q, k_view, v_view, metadata.kv_lens, block_tables, metadata.cu_q_lens, metadata.num_seqs,
        sm_scale=q.shape[-1] ** -0.5,
    )


class PagedDecoderLayer(nn.Module):
    """One decoder layer in scan form: `((x [T, embed], kv_cache), layer, cos, sin, metadata) -> ((x, kv_cache),
    None)`, `layer` the index of this layer in the stacked KV cache. A subclass writes the layer, `block`."""

    config: ModelConfig
    attention_fn: AttentionFn
    dtype: Any = jnp.float32
    projection_layout: str = IN_MAJOR  # how the projection weights are stored (`Projection.layout`)
    # Layers at or past this index pass the carry through unchanged (None: every layer runs): a self-speculative
    # draft scans the target's own stacked weights and runs only its first layers, so nothing is sliced (a
    # slice of stacked weights is a copy, on every call).
    run_below: int | None = None

    def block(
        self, x: jax.Array, kv_cache: KVCache, layer: jax.Array, cos: jax.Array, sin: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        """`x [T, embed]` through this layer (its submodules are created here): `(x, kv_cache)`."""
        raise NotImplementedError

    @nn.compact
    def __call__(
        self, carry: tuple[jax.Array, KVCache], layer: jax.Array, cos: jax.Array, sin: jax.Array,
        metadata: AttentionMetadata,
    ) -> tuple[tuple[jax.Array, KVCache], None]:
        if self.run_below is None:
            return self.block(*carry, layer, cos, sin, metadata), None
        return nn.cond(layer < self.run_below, lambda mdl, c: mdl.block(*c, layer, cos, sin, metadata),
                       lambda mdl, c: c, self, carry), None


class PagedDecoderLM(nn.Module):
    """The decoder every model here is: the model contract's fields and `__call__` (docs/design/models.md). A
    subclass names its token embedding (`embedding_name`), its layer (`layer_class`) and its final norm.

    `__call__(token_ids [T], positions [T], kv_cache, metadata, logits_indices [S]) -> (logits [S, vocab],
    kv_cache)`: token embedding, the layers over the stacked paged KV cache, then the final norm and LM head
    on the `logits_indices` rows only. With `apply_lm_head=False` it stops before the LM head and returns the
    final-normed rows `[S, embed]` (zeros past min(S, T)): the runner runs the head with the sampler, on only
    as many rows as the step has sequences (`lm_head_logits` on `lm_head_weight(params)`).

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
    # One `nn.scan` over parameters stacked on a leading "layers" axis (the serving default): the compiled
    # step holds one layer body, so compile time does not grow with depth. False unrolls them (`layers_{i}`).
    scan_layers: bool = True
    # How the layers' projection weights are stored (`Projection.layout`; out-major or panels on a CPU).
    projection_layout: str = IN_MAJOR
    # Run only the first `run_layers` decoder layers of the config's (None: all), then the final norm and LM
    # head: a self-speculative draft (`draft_runner`) over the target's own parameters and KV cache.
    run_layers: int | None = None

    # Name of the `[vocab, embed]` token embedding parameter (also the LM head when tied).
    embedding_name: ClassVar[str]
    # One layer, `layer_class(config, attention_fn, dtype)`.
    layer_class: ClassVar[type[PagedDecoderLayer]]

    def final_norm(self) -> nn.Module:
        """The norm before the LM head (a submodule, created inside `__call__`)."""
        raise NotImplementedError

    @nn.compact
    def __call__(
        self,
        token_ids: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        logits_indices: jax.Array,
        apply_lm_head: bool = True,
    ) -> tuple[jax.Array, KVCache]:
        c: ModelConfig = self.config
        start, end = self.layer_range or (0, c.num_hidden_layers)
        if not 0 <= start < end <= c.num_hidden_layers:
            raise ValueError(
                f"layer_range {self.layer_range} is not a non-empty range of {c.num_hidden_layers} layers"
            )
        num_layers = end - start
        if kv_cache[0].ndim != 5 or kv_cache[0].shape[0] != num_layers:
            raise ValueError(f"KV cache of shape {kv_cache[0].shape} is not [{num_layers}, blocks, block_size, "
                             "kv_heads, head_dim] for this model's layers")
        run = num_layers if self.run_layers is None else self.run_layers
        if not 0 < run <= num_layers or (self.run_layers is not None and self.layer_range is not None):
            raise ValueError(f"run_layers={self.run_layers} is not 1..{num_layers} of a whole model")
        is_last = end == c.num_hidden_layers
        if start == 0 or (is_last and c.tie_word_embeddings):
            embedding = self.param(
                self.embedding_name, weight_init(("vocab", "embed")), (c.vocab_size, c.hidden_size), self.dtype
            )
        x = jnp.take(embedding, token_ids, axis=0) if start == 0 else token_ids  # [T, embed]

        # RoPE angles once per step, shared by all layers.
        inv_freq = jnp.asarray(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        cos, sin = materialized(jnp.cos(angles)), materialized(jnp.sin(angles))  # [T, head_dim // 2]

        layer_args = (c, self.attention_fn, self.dtype)
        if self.scan_layers:
            layers = nn.scan(
                self.layer_class,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                length=num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},  # logical axis name of the stacked axis
            )(*layer_args, projection_layout=self.projection_layout, run_below=self.run_layers, name="layers")
            (x, kv_cache), _ = layers((x, kv_cache), jnp.arange(num_layers, dtype=jnp.int32), cos, sin, metadata)
        else:
            for i in range(run):  # global layer names; layer i of this stage's KV cache
                (x, kv_cache), _ = self.layer_class(*layer_args, projection_layout=self.projection_layout,
                                                    name=f"layers_{start + i}")(
                    (x, kv_cache), jnp.int32(i), cos, sin, metadata
                )
        if not is_last:
            return x, kv_cache

        # Only the rows that sample go through the final norm and the LM head. There is at most one per
        # sequence of the batch, so at most T of the S entries (the rest are padding): a small bucket does not
        # pay for max_num_seqs rows of the LM head (on a CPU, 64 rows of a 32k vocabulary cost ~20 ms).
        num_rows = min(logits_indices.shape[0], x.shape[0])
        h = self.final_norm()(x[logits_indices[:num_rows]])  # [min(S, T), embed]
        if c.tie_word_embeddings:
            weight = embedding
        else:
            weight = self.param("lm_head", weight_init(("vocab", "embed")), (c.vocab_size, c.hidden_size), self.dtype)
        out = lm_head_logits(h, weight, self.dtype) if apply_lm_head else h
        # Padding rows are zeros (their samples are never read).
        return jnp.pad(out, ((0, logits_indices.shape[0] - num_rows), (0, 0))), kv_cache  # [S, vocab or embed]

    def lm_head_weight(self, params: Any) -> jax.Array:
        """The LM head's weight `[vocab, embed]` in `params`: the embedding when tied, else `lm_head` (what
        `lm_head_logits` takes)."""
        return params[self.embedding_name if self.config.tie_word_embeddings else "lm_head"]


def lm_head_logits(h: jax.Array, weight: jax.Array, dtype: Any) -> jax.Array:
    """float32 logits `[R, vocab]` of final-normed rows `h [R, embed]`: the LM head of `PagedDecoderLM`, also
    run outside the model step (the runner's sampler, `sarathi_jax.parallel.stages.LMHead`). `weight` is
    `PagedDecoderLM.lm_head_weight` `[vocab, embed]` (tied or not: one layout, HF's); `dtype` the model's (its
    matmul precision)."""
    logits = jnp.einsum("se,ve->sv", h, weight, precision=matmul_precision(dtype), preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32)


def lm_head_logits_vocab_major(h: jax.Array, weight: jax.Array, dtype: Any) -> jax.Array:
    """float32 logits `[vocab, R]` of `h [R, embed]`: `lm_head_logits(h, weight, dtype).T`, the weight
    `[vocab, embed]` as the dot's left operand."""
    logits = jnp.einsum("ve,se->vs", weight, h, precision=matmul_precision(dtype), preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32)


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
