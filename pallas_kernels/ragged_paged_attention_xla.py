"""Ragged paged attention in plain jnp: the portable path and the engine's `"xla"` backend (its float64
oracle is `pallas_kernels/reference.py`).

Arguments, shapes and semantics: exactly those of the Pallas kernel, written once in the docstring of
`pallas_kernels/ragged_paged_attention.py` (q [T, Hq, D], the paged K/V cache, kv_lens, block_tables,
cu_q_lens and num_seqs; causal attention within each sequence; rows past the last sequence are zeros).

How the work is split (the cost tracks the real work, not T x the longest sequence)
---------------------------------------------------------------------------------
Every row goes through one of two paths; both run an online softmax (running max / sum / accumulator, all
float32; K and V are cast to float32 after the gather) over KV steps of whole pages, and both have loop
counts that depend on the data, so padding rows and padding sequences cost (almost) nothing.

* Query tiles (prefill sequences, q_len > 1, with more than `short_kv` KV tokens). Each sequence's rows
  are cut into tiles of `block_q` rows that never span two sequences (numbered consecutively, like the
  Pallas kernel's tiles, but from a small helper here because decode and short sequences are left out).
  A `lax.fori_loop` runs over the real tiles only; per tile, a nested `fori_loop` walks the sequence's
  pages `kv_pages_per_step` at a time, only up to the causal limit of the tile's last row. Each KV step
  is gathered once for all rows of the tile, and the GQA group is folded into the rows of the matmul
  (`[num_kv_heads, block_q * group, head_dim] x [step, num_kv_heads, head_dim]`), so each KV page is read
  once per tile, not once per query row or query head. The tile reads and writes a window of `block_q`
  rows (shifted back to stay inside [0, T)) and stores only its own rows.
* Per-row path (decode rows, q_len == 1, and all rows of prefill sequences with at most `short_kv` KV
  tokens, for which sharing KV reads does not pay). These rows are compacted into a list sorted by how
  far they look back (longest first), padded to a static multiple of `row_group` rows, and processed in
  groups of `row_group` rows by a loop over the occupied groups only. Each row gathers its own sequence's
  pages; a group's KV loop stops at the longest extent in that group, taking whole steps of the largest
  size in `row_kv_pages_per_step` while they fit, then smaller ones (so a short group, or the tail of a
  long one, gathers at most one small step past its longest row). Products are
  broadcast-multiply-reduce (XLA CPU runs those much faster than a batched matmul of [group, head_dim]
  slices). Results are scattered to their rows.

Rows past cu_q_lens[num_seqs] are never written and stay zero. Scores of positions a row may not see are
masked and the values there zeroed, and page ids are clipped into the cache, so stale or non-finite data in
unused cache slots (or block-table entries past a sequence's last page, whatever they hold) cannot leak into
the output. The split sizes are static (module constants below, tuned on a 2-core CPU for tiny-llama-like
shapes); `_ragged_paged_attention_xla` takes them as arguments (the tests use tiny ones).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention_common import MASK_VALUE, cdiv

# Default static split sizes (see the module docstring). Token counts are rounded down to whole pages (at
# least one page).
_BLOCK_Q = 64  # query rows per tile
_KV_STEP_TOKENS = 64  # KV tokens per step of a tile's loop
_ROW_GROUP = 32  # rows per group of the per-row path
_ROW_STEP_TOKENS = (64, 16)  # KV tokens per step of a group's loop: whole large steps, then small ones
_SHORT_KV = 32  # prefill sequences with at most this many KV tokens take the per-row path


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
    """Ragged paged attention in jnp; see the module docstring for the contract and how the work is split."""
    block_size = max(1, jnp.shape(k_pages)[1])
    return _ragged_paged_attention_xla(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale,
        block_q=_BLOCK_Q,
        kv_pages_per_step=max(1, _KV_STEP_TOKENS // block_size),
        row_group=_ROW_GROUP,
        row_kv_pages_per_step=tuple(max(1, t // block_size) for t in _ROW_STEP_TOKENS),
        short_kv=_SHORT_KV,
    )


def _online_softmax_step(carry, s, visible, pv):
    """Folds one KV step into (running max, running sum, accumulator).

    s: [..., rows, step] float32 scores; visible: broadcastable to s; pv(p) -> [..., rows, head_dim], the
    probabilities times the step's values (which must be zero where no row may read them).
    """
    m, l, acc = carry
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv(p)


def _finish(l, acc):
    return acc / jnp.where(l > 0.0, l, 1.0)[..., None]


def _ragged_paged_attention_xla(
    q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale, block_q, kv_pages_per_step,
    row_group, row_kv_pages_per_step, short_kv,
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

    pps = max(1, int(kv_pages_per_step))  # pages per KV step of the prefill tiles
    # Pages per KV step of the per-row path, largest first; each must be a multiple of the next.
    if isinstance(row_kv_pages_per_step, int):
        row_kv_pages_per_step = (row_kv_pages_per_step,)
    row_steps = sorted({max(1, int(x)) for x in row_kv_pages_per_step}, reverse=True)
    if any(a % b for a, b in zip(row_steps, row_steps[1:])):
        raise ValueError(f"row_kv_pages_per_step={row_kv_pages_per_step}: each size must be a multiple of the next smaller one")
    step_tokens = pps * block_size
    # Pad the block tables so that every KV step of either path reads whole columns.
    multiple = math.lcm(pps, *row_steps)
    padded_blocks = cdiv(max_blocks, multiple) * multiple
    if padded_blocks != max_blocks:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, padded_blocks - max_blocks)))
    # Garbage entries (and any id outside the cache) point at some real page; what they hold is masked.
    block_tables = jnp.clip(block_tables, 0, num_blocks - 1)

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
    scale = jnp.float32(sm_scale)
    # Every valid row is written exactly once, by its tile or its per-row group; padding rows stay zero.
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)

    # ---------------------------------------------------------------- per-row path
    # Decode rows, and rows of prefill sequences short enough that sharing their KV reads does not pay.
    row_seq_kv = seq_kv[row_seq]
    row_pos = row_seq_kv - cu_q_lens[row_seq + 1] + rows  # position of the row; it sees 0 .. row_pos
    short_seq = is_decode | (is_prefill & (seq_kv <= short_kv))
    per_row = row_valid & short_seq[row_seq]
    num_rows = jnp.sum(per_row).astype(jnp.int32)
    g_rows = int(max(1, min(row_group, num_tokens)))
    num_groups = cdiv(num_tokens, g_rows)
    # Per-row rows first, longest extent first (stable), then everything else.
    order = jnp.argsort(jnp.where(per_row, -row_pos, 1), stable=True).astype(jnp.int32)
    order = jnp.pad(order, (0, num_groups * g_rows - num_tokens))

    def row_kv_steps(rpps, first, count, qr, extent, seq_tables, carry):
        """Folds KV steps first .. first + count - 1 of `rpps` pages each into a group's online softmax."""
        c = rpps * block_size
        c_iota = jnp.arange(c, dtype=jnp.int32)
        # [steps, R, rpps]: each step's page ids as one contiguous slab.
        tables = seq_tables.reshape(g_rows, -1, rpps).transpose(1, 0, 2)

        def kv_step(b, carry):
            pages = tables[b]  # [R, rpps]
            vis = (b * c + c_iota)[None, :] < extent[:, None]  # [R, C]
            k = k_pages[pages].astype(jnp.float32).reshape(g_rows, c, num_kv_heads, head_dim)
            v = v_pages[pages].astype(jnp.float32).reshape(g_rows, c, num_kv_heads, head_dim)
            v = jnp.where(vis[:, :, None, None], v, 0.0)
            # Broadcast-multiply-reduce: XLA CPU runs these per-row products much faster than a batched dot.
            s = jnp.sum(qr[:, None] * k[:, :, :, None, :], axis=-1).transpose(0, 2, 3, 1)  # [R, H, G, C]
            # [R, H, G, D]
            pv = lambda p: jnp.sum(p.transpose(0, 3, 1, 2)[..., None] * v[:, :, :, None, :], axis=1)
            return _online_softmax_step(carry, s, vis[:, None, None, :], pv)

        return lax.fori_loop(first, first + count, kv_step, carry)

    def process_row_group(g, out):
        slot0 = g * g_rows
        rs = lax.dynamic_slice(order, (slot0,), (g_rows,))
        live = slot0 + jnp.arange(g_rows, dtype=jnp.int32) < num_rows
        extent = jnp.where(live, row_pos[rs] + 1, 0)  # [R] positions 0 .. extent - 1 are visible
        qr = jnp.where(live[:, None, None], q[rs].astype(jnp.float32) * scale, 0.0)
        qr = qr.reshape(g_rows, num_kv_heads, group, head_dim)
        seq_tables = block_tables[row_seq[rs]]  # [R, padded_blocks]
        carry = (
            jnp.full((g_rows, num_kv_heads, group), MASK_VALUE, jnp.float32),
            jnp.zeros((g_rows, num_kv_heads, group), jnp.float32),
            jnp.zeros((g_rows, num_kv_heads, group, head_dim), jnp.float32),
        )
        # Largest steps first while whole ones fit, then smaller ones; the smallest covers the rest.
        max_extent, done = jnp.max(extent), jnp.int32(0)  # done: tokens covered so far
        for i, rpps in enumerate(row_steps):
            c = rpps * block_size
            count = cdiv(max_extent - done, c) if i == len(row_steps) - 1 else (max_extent - done) // c
            carry = row_kv_steps(rpps, done // c, count, qr, extent, seq_tables, carry)
            done = done + count * c
        o = _finish(carry[1], carry[2]).reshape(g_rows, num_q_heads, head_dim)
        # Rows of dead slots go to distinct out-of-range indices and are dropped.
        dest = jnp.where(live, rs, num_tokens + jnp.arange(g_rows, dtype=jnp.int32))
        return out.at[dest].set(o, mode="drop", unique_indices=True)

    out = lax.fori_loop(0, cdiv(num_rows, g_rows), process_row_group, out)

    # ---------------------------------------------------------------- prefill tiles
    bq = int(max(1, min(block_q, num_tokens)))
    # Each tiled sequence has >= 2 rows (so there are at most T // 2 of them) and at most one partial tile.
    max_tiles = max(1, min(cdiv(num_tokens, bq) + min(max_num_seqs, num_tokens // 2), num_tokens))
    tiles_per_seq = jnp.where(is_prefill & ~short_seq, cdiv(q_lens, bq), 0)
    tile_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)
    num_tiles = tile_end[-1]
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    t_seq = jnp.minimum(jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32), max_num_seqs - 1)
    t_local = (t - (tile_end[t_seq] - tiles_per_seq[t_seq])) * bq  # first row of the tile within its sequence
    t_row0 = cu_q_lens[t_seq] + t_local
    t_rows = jnp.minimum(bq, q_lens[t_seq] - t_local)  # rows of the tile that belong to it
    t_kv = seq_kv[t_seq]
    t_pos0 = t_kv - q_lens[t_seq] + t_local  # position of the tile's first row
    t_kv_end = jnp.clip(t_pos0 + t_rows, 0, t_kv)
    # The tile reads and writes the window of bq rows starting at t_start, shifted back from t_row0 where
    # needed to stay inside [0, T); its own rows are window rows t_off .. t_off + t_rows - 1.
    t_start = jnp.minimum(t_row0, num_tokens - bq)
    t_off = t_row0 - t_start

    step_iota = jnp.arange(step_tokens, dtype=jnp.int32)
    window_iota = jnp.arange(bq, dtype=jnp.int32)
    # Row r of a tile's [bq * group] matrix is window row r // group.
    matrix_row = jnp.repeat(window_iota, group)

    def prefill_tile(i, out):
        seq, start, off, kv_len, kv_end = t_seq[i], t_start[i], t_off[i], t_kv[i], t_kv_end[i]
        qt = lax.dynamic_slice_in_dim(q, start, bq, axis=0).astype(jnp.float32) * scale
        qt = qt.reshape(bq, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
        qt = qt.reshape(num_kv_heads, bq * group, head_dim)
        q_pos = t_pos0[i] - off + matrix_row  # [bq * group]; rows outside the tile are never stored
        table = block_tables[seq]

        def kv_step(b, carry):
            pages = lax.dynamic_slice_in_dim(table, b * pps, pps)
            pos = b * step_tokens + step_iota  # [C]
            k = k_pages[pages].astype(jnp.float32).reshape(step_tokens, num_kv_heads, head_dim)
            v = v_pages[pages].astype(jnp.float32).reshape(step_tokens, num_kv_heads, head_dim)
            v = jnp.where((pos < kv_len)[:, None, None], v, 0.0)
            s = jnp.einsum("hrd,chd->hrc", qt, k, precision=precision)
            visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < kv_len)  # [bq * group, C]
            pv = lambda p: jnp.einsum("hrc,chd->hrd", p, v, precision=precision)
            return _online_softmax_step(carry, s, visible, pv)

        init = (
            jnp.full((num_kv_heads, bq * group), MASK_VALUE, jnp.float32),
            jnp.zeros((num_kv_heads, bq * group), jnp.float32),
            jnp.zeros((num_kv_heads, bq * group, head_dim), jnp.float32),
        )
        _, l, acc = lax.fori_loop(0, cdiv(kv_end, step_tokens), kv_step, init)
        o = _finish(l, acc).reshape(num_kv_heads, bq, group, head_dim).transpose(1, 0, 2, 3)
        o = o.reshape(bq, num_q_heads, head_dim)
        mine = (window_iota >= off) & (window_iota < off + t_rows[i])
        old = lax.dynamic_slice_in_dim(out, start, bq, axis=0)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None, None], o, old), start, axis=0)

    out = lax.fori_loop(0, num_tiles, prefill_tile, out)
    return out.astype(out_dtype)
