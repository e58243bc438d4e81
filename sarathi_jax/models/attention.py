"""Paged KV cache: per-step attention metadata, the cache write, and cache allocation.

The cache of one layer is a pair `(k_pages, v_pages)`, each `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token's flat slot is `block * block_size + offset`; `slot_mapping` gives it for every row of the step, with
-1 on padding rows.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from sarathi_jax.models.config import ModelConfig

# Logical axis names of one k_pages / v_pages array; a mesh shards the cache by kv head, like the k/v weights.
KV_CACHE_AXES: tuple[str | None, ...] = (None, None, "kv_heads", "head_dim")

KVCache = tuple[jax.Array, jax.Array]


@flax.struct.dataclass
class AttentionMetadata:
    """Everything about the batch layout that the attention of every layer shares (see docs/design.md)."""

    slot_mapping: jax.Array  # int32[T]: flat cache slot per token row; -1 for padding rows
    kv_lens: jax.Array  # int32[S]: cached tokens per sequence, this step's included
    block_tables: jax.Array  # int32[S, max_blocks_per_seq]
    cu_q_lens: jax.Array  # int32[S + 1]: sequence i owns rows cu_q_lens[i]:cu_q_lens[i + 1]
    num_seqs: jax.Array  # int32[1]


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's K/V rows (`[T, num_kv_heads, head_dim]`) into their cache slots.

    Padding rows (slot -1) are sent to an out-of-bounds slot and dropped by the scatter, so they never
    clobber a real slot. Under `jit(donate_argnums=...)` the update happens in place.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_pages.shape
    num_slots = num_blocks * block_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    k_flat = k_pages.reshape(num_slots, num_kv_heads, head_dim)
    v_flat = v_pages.reshape(num_slots, num_kv_heads, head_dim)
    k_flat = k_flat.at[slots].set(k.astype(k_pages.dtype), mode="drop")
    v_flat = v_flat.at[slots].set(v.astype(v_pages.dtype), mode="drop")
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    return (num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def init_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: Any) -> list[KVCache]:
    """Zero-filled caches, one `(k_pages, v_pages)` per layer."""
    shape = kv_cache_shape(config, num_blocks, block_size)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_hidden_layers)]
