"""Ragged paged attention in plain jnp: the portable reference path and the engine's `"xla"` backend.

Shapes and semantics (shared with the Pallas kernel in `ragged_paged_attention.py`):

  q:            [T, num_q_heads, head_dim]            T = padded token count (the bucket)
  k_pages:      [num_blocks, block_size, num_kv_heads, head_dim]   one layer's cache
  v_pages:      same shape and dtype as k_pages
  kv_lens:      int32[max_num_seqs]   tokens of each sequence in the cache, this step's included
  block_tables: int32[max_num_seqs, max_blocks_per_seq]
  cu_q_lens:    int32[max_num_seqs + 1]   sequence i's query rows are cu_q_lens[i]:cu_q_lens[i+1]
  num_seqs:     int32 scalar or int32[1]
  returns       [T, num_q_heads, head_dim] in q.dtype; rows at or past cu_q_lens[num_seqs] are zeros.

Query row j of sequence i sits at position kv_lens[i] - q_len_i + j and attends causally to positions
0 .. kv_lens[i] - q_len_i + j of the same sequence. Decode rows and prefill chunks with earlier context go
through the same code.

The loop runs over KV blocks (only as many as the longest sequence needs); each iteration gathers, for every
query row, one block of its own sequence and folds it into an online softmax with float32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_paged_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
) -> jax.Array:
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    kv_lens, block_tables, cu_q_lens = jnp.asarray(kv_lens), jnp.asarray(block_tables), jnp.asarray(cu_q_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    max_num_seqs = kv_lens.shape[0]

    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_row = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    row_valid = rows < cu_q_lens[num_seqs]
    seq_of_row = jnp.minimum(seq_of_row, max_num_seqs - 1)
    row_kv_len = jnp.where(row_valid, kv_lens[seq_of_row], 0)
    # Position of each query row; it may attend to positions 0..row_pos.
    row_pos = row_kv_len - cu_q_lens[seq_of_row + 1] + rows
    row_blocks = block_tables[seq_of_row]  # [T, max_blocks_per_seq]

    qg = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    seq_ids = jnp.arange(max_num_seqs)
    max_kv_len = jnp.max(jnp.where(seq_ids < num_seqs, kv_lens, 0))
    num_kv_blocks = (max_kv_len + block_size - 1) // block_size

    def body(b, carry):
        m, l, acc = carry
        pages = row_blocks[:, b]
        k = k_pages[pages].astype(jnp.float32)  # [T, block_size, Hkv, D]
        v = v_pages[pages].astype(jnp.float32)
        s = jnp.einsum("thgd,tshd->thgs", qg, k)
        kv_pos = b * block_size + jnp.arange(block_size, dtype=jnp.int32)
        mask = (kv_pos[None, :] <= row_pos[:, None]) & row_valid[:, None]  # [T, block_size]
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        # Zero values the row may not see, so stale or non-finite data in unused cache slots
        # cannot leak into the output through 0 * NaN.
        v = jnp.where(mask[:, :, None, None], v, 0.0)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("thgs,tshd->thgd", p, v)
        return m_new, l, acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_kv_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(row_valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
