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
0 .. kv_lens[i] - q_len_i + j of the same sequence.

How the work is split (so that the cost tracks the real work, not T x the longest sequence)
-------------------------------------------------------------------------------------------
Sequences are split by their query length; both parts use an online softmax with float32 accumulation
over KV steps of `kv_pages_per_step` pages (`_KV_STEP_TOKENS` tokens by default):

* Prefill sequences (q_len > 1) are cut into query tiles of `block_q` rows that never span two sequences
  (numbered consecutively, like the Pallas kernel's tiles). A `lax.fori_loop` with a data-dependent trip
  count runs over the real tiles only; for each tile a nested `fori_loop` walks the tile's sequence pages
  only up to the causal limit of its last row, and every KV step is read once for all `block_q` rows and
  all query heads of a KV head's GQA group (the group is folded into the row dimension of the matmul).
* Decode sequences (q_len == 1) are compacted into a static `[max_num_seqs]` list, sorted by context
  length (longest first) and processed in groups of `decode_rows` rows (loop count = number of groups with
  a decode in them); each row gathers its own sequence's pages, and a group's KV loop stops at the
  longest context in that group.

Each tile's output is written whole (no mask) into a row buffer in ascending row order, so a tile's rows
past its sequence's end are overwritten by the next tile; decode and padding rows are selected at the end.
Scores of positions a row may not see are masked and the values there zeroed, so stale or non-finite data
in unused cache slots (or block-table entries past a sequence's last page) cannot leak into the output.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax

# Default static split sizes (tuned on CPU for tiny-llama-like shapes; see the module docstring).
_BLOCK_Q = 64  # query rows per prefill tile
_KV_STEP_TOKENS = 128  # KV tokens per loop step (rounded down to whole pages, at least one page)
_DECODE_ROWS = 32  # per-row path: rows processed together
_ROW_STEP_TOKENS = 32  # per-row path: KV tokens per loop step
_SHORT_KV = 64  # prefill sequences with at most this many KV tokens take the per-row path

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _cdiv(a, b):
    return (a + b - 1) // b


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
    block_size = jnp.shape(k_pages)[1]
    return _ragged_paged_attention_xla(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, block_q=_BLOCK_Q, kv_pages_per_step=max(1, _KV_STEP_TOKENS // max(block_size, 1)),
        decode_rows=_DECODE_ROWS, row_kv_pages_per_step=max(1, _ROW_STEP_TOKENS // max(block_size, 1)),
        short_kv=_SHORT_KV,
    )


def _online_softmax_step(carry, s, visible, v, precision, pv_spec):
    """One KV step: s [..., rows, kv] masked scores, v already zeroed where no row may read it."""
    m, l, acc = carry
    s = jnp.where(visible, s, _MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = l * alpha + jnp.sum(p, axis=-1)
    acc = acc * alpha[..., None] + jnp.einsum(pv_spec, p, v, precision=precision)
    return m_new, l, acc


def _ragged_paged_attention_xla(
    q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale, block_q, kv_pages_per_step,
    decode_rows, row_kv_pages_per_step, short_kv,
):
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    kv_lens = jnp.asarray(kv_lens).astype(jnp.int32)
    block_tables = jnp.asarray(block_tables).astype(jnp.int32)
    cu_q_lens = jnp.asarray(cu_q_lens).astype(jnp.int32)
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_pages.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    num_seqs = jnp.reshape(jnp.asarray(num_seqs), ()).astype(jnp.int32)
    max_num_seqs, max_blocks = block_tables.shape
    out_dtype = q.dtype
    if num_tokens == 0:
        return jnp.zeros(q.shape, out_dtype)

    pps = int(kv_pages_per_step)
    step_tokens = pps * block_size
    padded_blocks = _cdiv(max_blocks, pps) * pps
    if padded_blocks != max_blocks:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, padded_blocks - max_blocks)))
    # Garbage entries (and any id outside the cache) point at some real page; what they hold is masked.
    block_tables = jnp.clip(block_tables, 0, num_blocks - 1)
    page_iota = jnp.arange(pps, dtype=jnp.int32)
    step_iota = jnp.arange(step_tokens, dtype=jnp.int32)

    # Per-sequence metadata ([max_num_seqs]).
    seq_ids = jnp.arange(max_num_seqs, dtype=jnp.int32)
    seq_valid = seq_ids < num_seqs
    q_lens = jnp.where(seq_valid, jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0), 0)
    seq_kv = jnp.where(seq_valid, jnp.clip(kv_lens, 0, max_blocks * block_size), 0)
    is_decode = seq_valid & (q_lens == 1)
    is_prefill = seq_valid & (q_lens > 1)

    # Per-row metadata ([T]).
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    row_seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32), max_num_seqs - 1)
    row_valid = rows < cu_q_lens[num_seqs]

    precision = lax.Precision.HIGHEST
    qf = q.astype(jnp.float32) * jnp.float32(sm_scale)

    # ---------------------------------------------------------------- per-row path
    # Decode rows, and rows of prefill sequences short enough that sharing their KV reads does not pay.
    row_seq_kv = seq_kv[row_seq]
    row_pos = row_seq_kv - cu_q_lens[row_seq + 1] + rows  # position of the row; it sees 0 .. row_pos
    short_seq = is_decode | (is_prefill & (seq_kv <= short_kv))
    per_row = row_valid & short_seq[row_seq]
    num_rows = jnp.sum(per_row).astype(jnp.int32)
    d_rows = int(max(1, min(decode_rows, num_tokens)))
    num_groups = _cdiv(num_tokens, d_rows)
    # Per-row rows first, longest extent first (stable), then everything else.
    order = jnp.argsort(jnp.where(per_row, -row_pos, 1), stable=True).astype(jnp.int32)
    order = jnp.pad(order, (0, num_groups * d_rows - num_tokens))
    slot_of_row = jnp.zeros(num_tokens, jnp.int32).at[order[:num_tokens]].set(rows)
    row_tables = block_tables  # indexed by sequence below
    rpps = max(1, int(row_kv_pages_per_step))
    row_step_tokens = rpps * block_size
    row_step_iota = jnp.arange(row_step_tokens, dtype=jnp.int32)

    def row_group(g, row_out):
        slot0 = g * d_rows
        rs = lax.dynamic_slice(order, (slot0,), (d_rows,))
        live = slot0 + jnp.arange(d_rows, dtype=jnp.int32) < num_rows
        extent = jnp.where(live, row_pos[rs] + 1, 0)  # [R] positions 0 .. extent - 1 are visible
        qr = jnp.where(live[:, None, None], qf[rs], 0.0).reshape(d_rows, num_kv_heads, group, head_dim)
        tables = row_tables[row_seq[rs]]  # [R, padded_blocks]

        def kv_step(b, carry):
            pages = lax.dynamic_slice_in_dim(tables, b * rpps, rpps, axis=1)  # [R, rpps]
            pos = b * row_step_tokens + row_step_iota
            vis = pos[None, :] < extent[:, None]  # [R, C]
            k = k_pages[pages].astype(jnp.float32).reshape(d_rows, row_step_tokens, num_kv_heads, head_dim)
            v = v_pages[pages].astype(jnp.float32).reshape(d_rows, row_step_tokens, num_kv_heads, head_dim)
            v = jnp.where(vis[:, :, None, None], v, 0.0)
            # Broadcast-multiply-reduce: XLA CPU runs these per-row products much faster than a batched dot.
            s = jnp.sum(qr[:, None] * k[:, :, :, None, :], axis=-1).transpose(0, 2, 3, 1)  # [R, H, G, C]
            m, l, acc = carry
            visible = vis[:, None, None, :]
            s = jnp.where(visible, s, _MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + jnp.sum(p, axis=-1)
            pv = jnp.sum(p.transpose(0, 3, 1, 2)[..., None] * v[:, :, :, None, :], axis=1)  # [R, H, G, D]
            return m_new, l, acc * alpha[..., None] + pv

        init = (
            jnp.full((d_rows, num_kv_heads, group), _MASK_VALUE, jnp.float32),
            jnp.zeros((d_rows, num_kv_heads, group), jnp.float32),
            jnp.zeros((d_rows, num_kv_heads, group, head_dim), jnp.float32),
        )
        _, l, acc = lax.fori_loop(0, _cdiv(jnp.max(extent), row_step_tokens), kv_step, init)
        o = (acc / jnp.where(l > 0.0, l, 1.0)[..., None]).reshape(d_rows, num_q_heads, head_dim)
        return lax.dynamic_update_slice(row_out, o, (slot0, 0, 0))

    row_out = jnp.zeros((num_groups * d_rows, num_q_heads, head_dim), jnp.float32)
    row_out = lax.fori_loop(0, _cdiv(num_rows, d_rows), row_group, row_out)

    # ---------------------------------------------------------------- prefill tiles
    bq = int(max(1, min(block_q, num_tokens)))
    # Every prefill sequence has >= 2 rows, so there are at most T // 2 of them and at most T // 2 tiles.
    max_tiles = max(1, min(_cdiv(num_tokens, bq) + min(max_num_seqs, num_tokens // 2), num_tokens // 2))
    tiles_per_seq = jnp.where(is_prefill & ~short_seq, _cdiv(q_lens, bq), 0)
    tile_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)
    num_tiles = tile_end[-1]
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    t_seq = jnp.minimum(jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32), max_num_seqs - 1)
    t_local = (t - (tile_end[t_seq] - tiles_per_seq[t_seq])) * bq  # first row of the tile within its sequence
    t_row0 = cu_q_lens[t_seq] + t_local
    t_kv = seq_kv[t_seq]
    t_pos0 = t_kv - q_lens[t_seq] + t_local  # position of the tile's first row
    t_kv_end = jnp.clip(t_pos0 + jnp.minimum(bq, q_lens[t_seq] - t_local), 0, t_kv)

    q_pad = jnp.pad(qf, ((0, bq), (0, 0), (0, 0)))
    # Row r of a tile's [bq * group] matrix is query row r // group.
    row_pos_off = jnp.repeat(jnp.arange(bq, dtype=jnp.int32), group)

    def prefill_tile(i, pre_out):
        seq, row0, kv_len, pos0, kv_end = t_seq[i], t_row0[i], t_kv[i], t_pos0[i], t_kv_end[i]
        qt = lax.dynamic_slice_in_dim(q_pad, row0, bq, axis=0).reshape(bq, num_kv_heads, group, head_dim)
        qt = qt.transpose(1, 0, 2, 3).reshape(num_kv_heads, bq * group, head_dim)
        q_pos = pos0 + row_pos_off  # [bq * group]
        table = block_tables[seq]

        def kv_step(b, carry):
            pages = lax.dynamic_slice_in_dim(table, b * pps, pps)
            pos = b * step_tokens + step_iota  # [C]
            k = k_pages[pages].astype(jnp.float32).reshape(step_tokens, num_kv_heads, head_dim)
            v = v_pages[pages].astype(jnp.float32).reshape(step_tokens, num_kv_heads, head_dim)
            v = jnp.where((pos < kv_len)[:, None, None], v, 0.0)
            s = jnp.einsum("hrd,chd->hrc", qt, k, precision=precision)
            visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < kv_len)  # [bq * group, C]
            return _online_softmax_step(carry, s, visible, v, precision, "hrc,chd->hrd")

        init = (
            jnp.full((num_kv_heads, bq * group), _MASK_VALUE, jnp.float32),
            jnp.zeros((num_kv_heads, bq * group), jnp.float32),
            jnp.zeros((num_kv_heads, bq * group, head_dim), jnp.float32),
        )
        _, l, acc = lax.fori_loop(0, _cdiv(kv_end, step_tokens), kv_step, init)
        o = acc / jnp.where(l > 0.0, l, 1.0)[..., None]
        o = o.reshape(num_kv_heads, bq, group, head_dim).transpose(1, 0, 2, 3).reshape(bq, num_q_heads, head_dim)
        return lax.dynamic_update_slice_in_dim(pre_out, o, row0, axis=0)

    pre_out = jnp.zeros((num_tokens + bq, num_q_heads, head_dim), jnp.float32)
    pre_out = lax.fori_loop(0, num_tiles, prefill_tile, pre_out)

    # ---------------------------------------------------------------- assemble
    out = jnp.where(
        per_row[:, None, None], row_out[slot_of_row],
        jnp.where(row_valid[:, None, None], pre_out[:num_tokens], 0.0),
    )
    return out.astype(out_dtype)
