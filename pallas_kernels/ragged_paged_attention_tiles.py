"""The metadata pass of the Pallas ragged paged attention kernel: which rows each query tile covers, how much
KV it needs, and (decode tiles) how its KV range is split.

A few cheap jnp ops on `[max_num_seqs]`-sized arrays, run outside the kernels under the same jit. See
`ragged_paged_attention.py` for how the kernels use the result.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.attention_common import cdiv

# Rows of the int32 tile-metadata arrays passed to the kernels.
KIND, SEQ, ROW0, ROW_END, POS0, KV_END, NUM_SPLITS, SPLIT_STEPS = range(8)
NUM_META = 8
KIND_EMPTY, KIND_COMPUTE, KIND_ZERO = 0, 1, 2


def max_tiles(*, num_tokens: int, max_num_seqs: int, decode_block_q: int, prefill_block_q: int) -> tuple[int, int]:
    """Static upper bounds on the number of (decode, prefill) tiles of any batch with these shapes.

    Decode tiles: one per sequence with 1 <= q_len <= decode_block_q. Prefill tiles: the sequences with
    q_len > decode_block_q (at most T // (decode_block_q + 1) of them) cut into tiles of prefill_block_q
    rows, then the zero tiles of the padding rows; together they cover at most T rows, so at most
    cdiv(T, prefill_block_q) + (number of such sequences) + 1 tiles.
    """
    num_decode = min(max_num_seqs, num_tokens) if decode_block_q > 0 else 0
    num_prefill_seqs = min(max_num_seqs, num_tokens // (decode_block_q + 1))
    return num_decode, cdiv(num_tokens, prefill_block_q) + num_prefill_seqs + 1


def _tile_owner(tiles_per_seq, t):
    """For global tile ids `t` (tiles numbered sequence after sequence): (sequence, tile index within it)."""
    tile_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)
    seq = jnp.sum(tile_end[None, :] <= t[:, None], axis=1).astype(jnp.int32)
    seq = jnp.minimum(seq, tiles_per_seq.shape[0] - 1)
    return seq, t - (tile_end[seq] - tiles_per_seq[seq]), tile_end[-1]


def tile_metadata(
    kv_lens, cu_q_lens, num_seqs, *, num_tokens: int, decode_block_q: int, prefill_block_q: int,
    max_decode_tiles: int, max_prefill_tiles: int, max_kv_len: int, decode_block_kv: int, max_splits: int,
    min_split_steps: int, split_target_programs: int, num_kv_heads: int,
):
    """(decode metadata int32[NUM_META, max_decode_tiles], prefill metadata int32[NUM_META, max_prefill_tiles]).

    Per tile: KIND (empty / compute / zero), SEQ, rows [ROW0, ROW_END) (a tile of block_q rows stores only
    rows < ROW_END), POS0 (position of the tile's first row), KV_END (positions [0, KV_END) are visible to
    some row of the tile). Decode tiles also carry NUM_SPLITS (KV splits actually used, 1 .. max_splits)
    and SPLIT_STEPS (KV steps of decode_block_kv tokens per split); splits are chosen so none is empty.
    """
    max_num_seqs = kv_lens.shape[0]
    seq_ids = jnp.arange(max_num_seqs, dtype=jnp.int32)
    q_lens = jnp.where(seq_ids < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    q_lens = jnp.maximum(q_lens, 0)
    is_decode = (q_lens >= 1) & (q_lens <= decode_block_q)
    pad_start = jnp.minimum(cu_q_lens[num_seqs], num_tokens)

    def common(kind, seq, row0, row_end, valid_compute, valid_any, last_row):
        seq_start, seq_end = cu_q_lens[seq], cu_q_lens[seq + 1]
        kv_len = jnp.minimum(kv_lens[seq], max_kv_len)
        context = kv_len - (seq_end - seq_start)
        pos0 = context + (row0 - seq_start)
        kv_end = jnp.clip(context + (last_row - seq_start), 0, kv_len)
        z = jnp.zeros_like(seq)
        return [
            kind,
            jnp.where(valid_compute, seq, z),
            jnp.where(valid_any, row0, z),
            jnp.where(valid_any, row_end, z),
            jnp.where(valid_compute, pos0, z),
            jnp.where(valid_compute, kv_end, z),
        ]

    # Prefill tiles: sequences with q_len > decode_block_q, then zero tiles over the padding rows.
    t = jnp.arange(max_prefill_tiles, dtype=jnp.int32)
    tiles_per_seq = jnp.where(is_decode, 0, cdiv(q_lens, prefill_block_q))
    seq, local, num_compute = _tile_owner(tiles_per_seq, t)
    num_zero = cdiv(num_tokens - pad_start, prefill_block_q)
    is_compute = t < num_compute
    is_zero = (~is_compute) & (t - num_compute < num_zero)
    kind = jnp.where(is_compute, KIND_COMPUTE, jnp.where(is_zero, KIND_ZERO, KIND_EMPTY))
    row0 = jnp.where(is_compute, cu_q_lens[seq] + local * prefill_block_q,
                     pad_start + (t - num_compute) * prefill_block_q)
    row_end = jnp.where(is_compute, cu_q_lens[seq + 1], num_tokens)
    last_row = jnp.minimum(row0 + prefill_block_q, row_end)
    zeros = jnp.zeros_like(t)
    prefill = common(kind, seq, row0, row_end, is_compute, is_compute | is_zero, last_row) + [zeros, zeros]
    prefill = jnp.stack([x.astype(jnp.int32) for x in prefill])
    if max_decode_tiles == 0:
        return jnp.zeros((len(prefill), 0), jnp.int32), prefill

    # Decode tiles: one per sequence with 1 <= q_len <= decode_block_q.
    t = jnp.arange(max_decode_tiles, dtype=jnp.int32)
    seq, _, num_decode = _tile_owner(is_decode.astype(jnp.int32), t)
    is_compute = t < num_decode
    kind = jnp.where(is_compute, KIND_COMPUTE, KIND_EMPTY)
    row0, row_end = cu_q_lens[seq], cu_q_lens[seq + 1]
    decode = common(kind, seq, row0, row_end, is_compute, is_compute, row_end)
    # Splits: enough that about split_target_programs programs run, each split at least min_split_steps
    # steps long, at most max_splits; then even sizes, so that no split is empty.
    num_steps = cdiv(decode[KV_END], decode_block_kv)
    want = cdiv(split_target_programs, jnp.maximum(num_decode, 1) * num_kv_heads)
    splits = jnp.clip(jnp.minimum(want, cdiv(num_steps, min_split_steps)), 1, max_splits)
    steps = jnp.maximum(cdiv(num_steps, splits), 1)
    splits = jnp.maximum(cdiv(num_steps, steps), 1)
    decode += [jnp.where(is_compute, splits, 0), jnp.where(is_compute, steps, 0)]
    return jnp.stack([x.astype(jnp.int32) for x in decode]), prefill
