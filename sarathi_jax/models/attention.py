"""Paged KV cache: per-step attention metadata, the cache write, and cache allocation.

The cache of a model (or of a pipeline stage) is one pair `(k_pages, v_pages)`, each
`[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`: the layers are stacked, like the scanned layer
parameters, so the layer scan carries the whole cache and updates it in place. A token's flat slot within a
layer is `block * block_size + offset`; `slot_mapping` gives it for every row of the step, with -1 on padding
rows. Layer `l` sees the cache as `num_layers * num_blocks` blocks of which its own are
`l * num_blocks ... (l + 1) * num_blocks - 1` (`layer_view`), so the attention kernels read pages straight
from the stacked cache through offset block tables, and no layer's cache is ever sliced out (a copy).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from sarathi_jax.models.config import ModelConfig

# Logical axis names of k_pages / v_pages; a mesh shards the cache by kv head, like the k/v weights.
KV_CACHE_AXES: tuple[str | None, ...] = ("layers", None, None, "kv_heads", "head_dim")

KVCache = tuple[jax.Array, jax.Array]


@flax.struct.dataclass
class AttentionMetadata:
    """Everything about the batch layout that the attention of every layer shares (the attention contract:
    docs/design/kernels.md)."""

    slot_mapping: jax.Array  # int32[T]: flat cache slot per token row; -1 for padding rows
    kv_lens: jax.Array  # int32[S]: cached tokens per sequence, this step's included
    block_tables: jax.Array  # int32[S, max_blocks_per_seq]
    cu_q_lens: jax.Array  # int32[S + 1]: sequence i owns rows cu_q_lens[i]:cu_q_lens[i + 1]
    num_seqs: jax.Array  # int32[1]


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, layer: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter layer `layer`'s K/V rows of this step (`[T, num_kv_heads, head_dim]`) into their slots of the
    stacked cache (`[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`).

    Padding rows (slot -1) are sent to an out-of-bounds slot and dropped by the scatter, so they never
    clobber a real slot. Under `jit(donate_argnums=...)` (and as a scan carry) the update happens in place.
    """
    num_layers, num_blocks, block_size, num_kv_heads, head_dim = k_pages.shape
    layer_slots = num_blocks * block_size
    num_slots = num_layers * layer_slots
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping + layer * layer_slots)
    k_flat = k_pages.reshape(num_slots, num_kv_heads, head_dim)
    v_flat = v_pages.reshape(num_slots, num_kv_heads, head_dim)
    k_flat = k_flat.at[slots].set(k.astype(k_pages.dtype), mode="drop")
    v_flat = v_flat.at[slots].set(v.astype(v_pages.dtype), mode="drop")
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def layer_view(pages: jax.Array, block_tables: jax.Array, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(pages as [num_layers * num_blocks, block_size, kv_heads, head_dim], layer's block tables)`: the
    attention kernels' one-layer cache signature over the stacked cache, without slicing it (a reshape of
    the leading axes is free; a slice would copy a whole layer's cache every layer)."""
    num_layers, num_blocks = pages.shape[:2]
    return pages.reshape(num_layers * num_blocks, *pages.shape[2:]), block_tables + layer * num_blocks


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int, num_layers: int | None = None
                   ) -> tuple[int, int, int, int, int]:
    """`[num_layers, num_blocks, block_size, kv_heads, head_dim]`; `num_layers` defaults to the whole model."""
    layers = config.num_hidden_layers if num_layers is None else num_layers
    return (layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def init_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: Any,
                  num_layers: int | None = None) -> KVCache:
    """A zero-filled stacked cache `(k_pages, v_pages)` for `num_layers` layers (default: all of them)."""
    shape = kv_cache_shape(config, num_blocks, block_size, num_layers)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
