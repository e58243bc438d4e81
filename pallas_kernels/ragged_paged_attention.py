"""Ragged paged attention as Pallas kernels (GPU / Triton backend, or interpret mode anywhere).

The same arguments, shapes and semantics as `ragged_paged_attention_xla` (which points here for them), so
the engine can swap one for the other; the float64 numpy reference of those semantics is
`pallas_kernels/reference.py` (`ragged_paged_attention_reference`):

  q:            [T, num_q_heads, head_dim]            T = padded token count (the bucket)
  k_pages:      [num_blocks, block_size, num_kv_heads, head_dim]   one layer's cache
  v_pages:      same shape and dtype as k_pages
  kv_lens:      int32[max_num_seqs]   tokens of each sequence in the cache, this step's included
  block_tables: int32[max_num_seqs, max_blocks_per_seq]
  cu_q_lens:    int32[max_num_seqs + 1]   sequence i's query rows are cu_q_lens[i]:cu_q_lens[i+1]
  num_seqs:     int32 scalar or int32[1]
  returns       [T, num_q_heads, head_dim] in q.dtype; rows at or past cu_q_lens[num_seqs] are zeros.

Query row j of sequence i sits at position kv_lens[i] - q_len_i + j and attends causally to positions
0 .. kv_lens[i] - q_len_i + j of the same sequence. A sequence with q_len 0 owns no rows and produces nothing.

How the work is split
---------------------
GQA: the `G = num_q_heads // num_kv_heads` query heads that share KV head `h` are processed together as the
rows of one matrix (`G_pad = next_power_of_2(G)`, padded with zero heads in the wrapper only when G is not a
power of two), so each KV page is read once per query tile for the whole group. A *query tile* is
`block_q` consecutive query rows of one sequence, i.e. a `[block_q * G_pad, head_dim]` matrix.

There are two tile kinds, with separate static shapes (`KernelConfig.decode` / `KernelConfig.prefill`):

* decode tiles: a sequence with 1 <= q_len <= decode.block_q (decodes, and very short chunks) is one tile.
  decode.block_q is chosen so that `block_q * G_pad` is Triton's minimum of 16 matmul rows (or G_pad).
* prefill tiles: the rows of every longer sequence cut into tiles of prefill.block_q rows (64-128 matmul
  rows by default), followed by *zero tiles* that cover the padding rows cu_q_lens[num_seqs] .. T.

The metadata pass (`ragged_paged_attention_tiles.py`, a few jnp ops on [max_num_seqs]-sized arrays) assigns
each sequence to a kind and numbers the tiles of each kind consecutively into int32 metadata (kind, sequence,
rows, first query position, KV extent; decode tiles also their KV split). Tile counts are data dependent but
bounded by static numbers (`tiles.max_tiles`); unused tiles exit at once. Then up to three `pallas_call`s:

1. prefill, grid `(max_prefill_tiles, num_kv_heads)`: zero tiles store zeros to their padding rows; compute
   tiles run the flash-attention loop below over KV steps of prefill.kv_pages_per_block pages and store
   their normalised rows. Decode rows of the output are left unwritten here.
2. decode, grid `(max_decode_tiles, num_kv_heads, max_splits)` (*split-KV*, flash-decoding): the KV range of
   a decode tile, in steps of decode.kv_pages_per_block pages, is cut into NUM_SPLITS contiguous,
   non-empty, step-aligned sub-ranges, one per program along the third grid axis. Each program stores the
   float32 softmax state of its sub-range (unnormalised accumulator, running max, running sum; an empty
   sub-range would store the neutral state max = mask value, sum = 0) into scratch outputs of shape
   `[max_splits, max_decode_tiles, num_kv_heads, rows(, head_dim)]` (the accumulator with a masked store of
   the tile's real rows only); programs past the tile's NUM_SPLITS do nothing, and a tile with NUM_SPLITS
   == 1 stores its normalised rows straight into the output (aliased), skipping the scratch and the merge.
   NUM_SPLITS is computed per tile from the data: enough splits that about
   `split_target_programs` programs run, each at least `min_split_kv` tokens long, at most `max_splits`.
   `max_splits` (the grid size) is static (from the tuning table or rules: a function of the cache's max
   context), so nothing recompiles at serving time.
3. merge, grid `(max_decode_tiles, num_kv_heads)`: folds a decode tile's NUM_SPLITS > 1 states (rescaling by
   the running maxima) into normalised rows and stores them into the output of step 1, aliased
   (`input_output_aliases`), so the two kinds write disjoint rows of one buffer.
   With `max_splits == 1` steps 2 and 3 are one direct call (decode tiles store normalised rows into the
   aliased output); with decode.block_q == 0 there are no decode tiles and only step 1 runs.

The per-tile loop (steps 1 and 2): the tile's `[block_q * G_pad, head_dim]` query matrix is loaded once (masked
to its rows); then `lax.fori_loop`s walk KV steps, only up to the last position the tile's last row may see
(causal early exit; nothing past the sequence's length). Steps that every row of the tile sees entirely
(they end at or before the first row's position) run without masks; only the remaining steps at the causal
diagonal and the sequence end mask scores and values. Each step reads the page ids from `block_tables`,
gathers the pages' K and V for head `h`, and folds them into an online softmax (running max / sum /
accumulator, all float32; scores in float32; the probabilities are cast to the value dtype for the second
matmul, as in flash attention; float32 inputs use full-precision IEEE matmuls, not Triton's TF32 default).
Rows are stored with masked stores, so rows of neighbouring sequences are never clobbered.

Every output row is written exactly once (prefill rows and padding rows by step 1, decode rows by step 3 or
the direct decode call), so the output buffer needs no initialisation. Keys/values at positions a query may
not see are masked in the scores *and* zeroed in V, and page ids are clipped into the cache, so stale or
non-finite data in unused cache slots (or block-table entries past a sequence's last page) cannot leak into
the output.

Static configuration
--------------------
`KernelConfig` (`pallas_kernels/tuning.py`): per tile kind `block_q`, `kv_pages_per_block`, `num_warps`,
`num_stages`; and `max_splits`, `min_split_kv`, `split_target_programs`. It is resolved at trace time from the
shapes (dtype, head_dim, G_pad, block_size, T and max context bucketed to powers of two) in the tuning table
`pallas_kernels/tuning_table.json` (written by `python -m pallas_kernels.tune` on a GPU; the committed table
holds rule-based defaults, `"tuned": false`), falling back to rules where the table has no entry.
`resolve_kernel_config` says which config (and which table entry) a shape gets. Arguments `block_q`,
`num_kv_pages_per_block`, `num_warps`, `num_stages`, `num_kv_splits` override single fields; `config`
replaces the lookup. All are static (the jitted implementation takes `sm_scale`, `interpret` and the
resolved `config` as static arguments).

Block-size constraints: `block_q` (each kind) and `kv_pages_per_block` are powers of two,
`block_q * G_pad >= 16` and `kv_pages_per_block * block_size >= 16` (Triton's `tt.dot` needs every matmul dim
>= 16); `max_splits` is a power of two. For the compiled Triton path (`interpret=False`) `block_size` and
`head_dim` must also be powers of two and `head_dim >= 16` (Triton tensors have power-of-two sizes);
interpret mode does not need these two.

Costs and limits: a decode tile of q_len rows uses `block_q * G_pad >= 16` matmul rows of which `q_len * G`
are real (at most 4x padding for G = 4; decode is memory bound, so this costs issue slots, not bandwidth).
Sequences are never packed together into one tile (their KV differs). The scratch of the split path is
`max_splits * max_decode_tiles * num_kv_heads * block_q * G_pad * (head_dim + 2)` float32 (allocated per call,
touched only for the splits actually used). Prefill tiles are not split over KV, so a short chunk just above
decode.block_q rows after a very long context keeps only `num_kv_heads` programs per tile busy.

Backends
--------
* GPU: lowers through Pallas's Triton backend (`jax.experimental.pallas.triton`); no TPU-only primitives
  and no scalar prefetch are used.
* CPU (or anywhere): `interpret=True` runs the same kernel bodies through the Pallas interpreter (slow;
  for tests).
* TPU: not provided. JAX ships a TPU ragged paged attention kernel
  (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), but it wants K and V interleaved in a single
  `[num_blocks, block_size, 2 * num_kv_heads, head_dim]` cache, so using it here would mean re-packing
  the whole cache every call; use the `"xla"` backend on TPU instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import ragged_paged_attention_tiles as tiles
from pallas_kernels.attention_common import MASK_VALUE as DEFAULT_MASK_VALUE, cdiv as _cdiv
from pallas_kernels.tuning import KernelConfig, TileConfig, next_pow2 as _next_pow2, resolve_config

__all__ = ["ragged_paged_attention", "resolve_kernel_config", "KernelConfig", "TileConfig", "DEFAULT_MASK_VALUE"]

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _attention_kernel(meta_ref, block_tables_ref, q_ref, k_ref, v_ref, *refs, sm_scale, block_q,
                      num_kv_pages_per_block, num_blocks, mask_value, mode):
    """One program: query tile `program_id(0)`, KV head `program_id(1)`, and in mode "partial" KV split
    `program_id(2)`. Modes: "direct" writes normalised rows (and zero tiles) to the output; "aliased" does
    the same with the output aliased to an extra (unread) input; "partial" (output aliased too) writes the
    float32 softmax state (acc, running max, running sum) of its KV split for the merge pass, or, for a tile
    with a single split, its normalised rows straight to the output."""
    if mode == "partial":
        _, o_ref, acc_ref, m_ref, l_ref = refs
    else:
        o_ref = refs[-1]
    t = pl.program_id(0)
    _, g_pad, head_dim = q_ref.shape
    block_size = k_ref.shape[1]
    block_kv = num_kv_pages_per_block * block_size
    rows = block_q * g_pad

    kind = meta_ref[tiles.KIND, t]
    row0 = meta_ref[tiles.ROW0, t]
    row_end = meta_ref[tiles.ROW_END, t]
    # Rows [row0, row_end) of this tile are ours; mask for a [block_q, g_pad, head_dim] tile.
    row_mask = lax.broadcasted_iota(jnp.int32, (block_q, g_pad, head_dim), 0) < (row_end - row0)

    if mode != "partial":
        @pl.when(kind == tiles.KIND_ZERO)
        def _zero():
            plgpu.store(o_ref.at[pl.ds(row0, block_q)], jnp.zeros((block_q, g_pad, head_dim), o_ref.dtype),
                        mask=row_mask)

    seq = meta_ref[tiles.SEQ, t]
    pos0 = meta_ref[tiles.POS0, t]  # position of the tile's first query row
    kv_end = meta_ref[tiles.KV_END, t]  # KV positions [0, kv_end) are visible to some row of the tile
    num_steps = _cdiv(kv_end, block_kv)
    if mode == "partial":
        split = pl.program_id(2)
        split_steps = meta_ref[tiles.SPLIT_STEPS, t]
        active = (kind == tiles.KIND_COMPUTE) & (split < meta_ref[tiles.NUM_SPLITS, t])
        lo = split * split_steps
        hi = jnp.minimum(lo + split_steps, num_steps)
    else:
        active = kind == tiles.KIND_COMPUTE
        lo, hi = 0, num_steps
    # Steps [lo, full) are visible to every row of the tile (they end at or before the first row's
    # position): no causal or length mask there. Steps [full, hi) are masked.
    full = jnp.clip((pos0 + 1) // block_kv, lo, hi)

    @pl.when(active)
    def _compute():
        # float32 inputs: full-precision (IEEE) matmuls; Triton's default for float32 would be TF32.
        precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
        q = plgpu.load(q_ref.at[pl.ds(row0, block_q)], mask=row_mask, other=0).reshape(rows, head_dim)
        # Query position of each of the block_q * g_pad matrix rows (row r is query r // g_pad).
        q_pos = pos0 + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) // g_pad
        kv_iota = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        kv_iota_1d = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
        page_iota = lax.broadcasted_iota(jnp.int32, (num_kv_pages_per_block,), 0)
        num_pages = _cdiv(kv_end, block_size)

        def step(masked, b, carry):
            m_prev, l_prev, acc_prev = carry
            first_page = b * num_kv_pages_per_block
            pages = block_tables_ref[seq, pl.ds(first_page, num_kv_pages_per_block)]
            if masked:
                # Pages past the sequence's end may hold anything: point them at page 0 (their scores are
                # masked and their values zeroed below).
                pages = jnp.where(page_iota + first_page < num_pages, pages, 0)
            pages = jnp.clip(pages, 0, num_blocks - 1)  # never index outside the cache
            k = k_ref[pages].reshape(block_kv, head_dim)
            v = v_ref[pages].reshape(block_kv, head_dim)
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale  # [rows, block_kv]
            kv_start = b * block_kv
            if masked:
                kv_pos = kv_start + kv_iota
                visible = (kv_pos <= q_pos) & (kv_pos < kv_end)
                s = jnp.where(visible, s, mask_value)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next[:, None])
            if masked:
                p = jnp.where(visible, p, 0.0)
                v = jnp.where(kv_start + kv_iota_1d < kv_end, v, jnp.zeros_like(v))
            l_next = l_prev * alpha + jnp.sum(p, axis=1)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)  # [rows, head_dim]
            return m_next, l_next, acc_prev * alpha[:, None] + pv

        carry = (
            jnp.full((rows,), mask_value, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        )
        carry = lax.fori_loop(lo, full, functools.partial(step, False), carry)
        m, l, acc = lax.fori_loop(full, hi, functools.partial(step, True), carry)
        def store_rows():
            l_safe = jnp.where(l > 0.0, l, 1.0)
            out = (acc / l_safe[:, None]).astype(o_ref.dtype).reshape(block_q, g_pad, head_dim)
            plgpu.store(o_ref.at[pl.ds(row0, block_q)], out, mask=row_mask)

        if mode == "partial":
            single = meta_ref[tiles.NUM_SPLITS, t] == 1
            pl.when(single)(store_rows)

            @pl.when(~single)
            def _store_partial():
                # Only the tile's real rows travel (a decode tile is mostly padding rows). An empty split
                # (lo >= hi) would store the neutral state: max = mask_value, sum = 0, acc = 0.
                real = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0) // g_pad < (row_end - row0)
                plgpu.store(acc_ref, acc, mask=real)
                m_ref[...] = m
                l_ref[...] = l
        else:
            store_rows()


def _merge_kernel(meta_ref, acc_ref, m_ref, l_ref, _aliased_out_ref, o_ref, *, block_q, mask_value):
    """One program per (decode tile, KV head): folds the tile's NUM_SPLITS (> 1) partial states (in split
    order) into normalised rows and stores them (masked) into the aliased output. Tiles with one split
    already wrote their rows."""
    t = pl.program_id(0)
    _, g_pad, head_dim = o_ref.shape
    rows = block_q * g_pad
    kind = meta_ref[tiles.KIND, t]
    row0 = meta_ref[tiles.ROW0, t]
    row_end = meta_ref[tiles.ROW_END, t]

    num_splits = meta_ref[tiles.NUM_SPLITS, t]
    real = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0) // g_pad < (row_end - row0)

    @pl.when((kind == tiles.KIND_COMPUTE) & (num_splits > 1))
    def _merge():
        def body(s, carry):
            m, l, acc = carry
            m_s, l_s = m_ref[s], l_ref[s]
            acc_s = plgpu.load(acc_ref.at[s], mask=real, other=0.0)
            m_next = jnp.maximum(m, m_s)
            a, b = jnp.exp(m - m_next), jnp.exp(m_s - m_next)
            return m_next, l * a + l_s * b, acc * a[:, None] + acc_s * b[:, None]

        init = (
            jnp.full((rows,), mask_value, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        )
        _, l, acc = lax.fori_loop(0, num_splits, body, init)
        l = jnp.where(l > 0.0, l, 1.0)
        out = (acc / l[:, None]).astype(o_ref.dtype).reshape(block_q, g_pad, head_dim)
        row_mask = lax.broadcasted_iota(jnp.int32, (block_q, g_pad, head_dim), 0) < (row_end - row0)
        plgpu.store(o_ref.at[pl.ds(row0, block_q)], out, mask=row_mask)


def _validate_shapes(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, interpret):
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages and v_pages shapes differ: {k_pages.shape} vs {v_pages.shape}")
    if not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise ValueError(
            f"q, k_pages and v_pages must share a dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}; expected one of {[str(d) for d in _SUPPORTED_DTYPES]}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, head_dim_k = k_pages.shape
    if head_dim_k != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, k_pages/v_pages have {head_dim_k}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if block_size == 0 or num_blocks == 0:
        raise ValueError(f"empty KV cache: k_pages shape {k_pages.shape}")
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be [max_num_seqs], got shape {kv_lens.shape}")
    max_num_seqs = kv_lens.shape[0]
    if max_num_seqs == 0:
        raise ValueError("max_num_seqs (kv_lens.shape[0]) must be positive")
    if block_tables.ndim != 2 or block_tables.shape[0] != max_num_seqs:
        raise ValueError(
            f"block_tables must be [max_num_seqs={max_num_seqs}, max_blocks_per_seq], got {block_tables.shape}"
        )
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables has no columns (max_blocks_per_seq == 0)")
    if cu_q_lens.shape != (max_num_seqs + 1,):
        raise ValueError(f"cu_q_lens must be [max_num_seqs + 1 = {max_num_seqs + 1}], got {cu_q_lens.shape}")
    if num_seqs.size != 1:
        raise ValueError(f"num_seqs must be a scalar or have shape [1], got shape {num_seqs.shape}")
    for name, x in (("kv_lens", kv_lens), ("block_tables", block_tables), ("cu_q_lens", cu_q_lens),
                    ("num_seqs", num_seqs)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {x.dtype}")
    if not interpret:
        if not _is_pow2(block_size):
            raise ValueError(f"the Triton path needs a power-of-two block_size, got {block_size}")
        if not _is_pow2(head_dim) or head_dim < 16:
            raise ValueError(f"the Triton path needs a power-of-two head_dim >= 16, got {head_dim}")


def _validate_config(config: KernelConfig, *, group_pad: int, block_size: int):
    for kind, tile in (("decode", config.decode), ("prefill", config.prefill)):
        if kind == "decode" and tile.block_q == 0:
            continue  # decode tiles disabled
        if not _is_pow2(tile.block_q):
            raise ValueError(f"{kind} block_q={tile.block_q} must be a power of two")
        if tile.block_q * group_pad < 16:
            raise ValueError(
                f"{kind} block_q * next_power_of_2(num_q_heads // num_kv_heads) = {tile.block_q} * {group_pad} "
                "must be >= 16"
            )
        if not _is_pow2(tile.kv_pages_per_block):
            raise ValueError(f"{kind} num_kv_pages_per_block={tile.kv_pages_per_block} must be a power of two")
        if tile.kv_pages_per_block * block_size < 16:
            raise ValueError(
                f"{kind} num_kv_pages_per_block * block_size = {tile.kv_pages_per_block} * {block_size} must be >= 16"
            )
    if not _is_pow2(config.max_splits):
        raise ValueError(f"num_kv_splits (max_splits)={config.max_splits} must be a power of two")
    if config.min_split_kv < 1 or config.split_target_programs < 1:
        raise ValueError("min_split_kv and split_target_programs must be positive")


def _validate_values(q, k_pages, kv_lens, block_tables, cu_q_lens, num_seqs):
    """Value checks, only where the metadata is concrete (not traced under jit)."""
    if not all(_is_concrete(x) for x in (kv_lens, cu_q_lens, num_seqs)):
        return
    num_tokens, block_size, max_num_seqs = q.shape[0], k_pages.shape[1], kv_lens.shape[0]
    kv = np.asarray(kv_lens).astype(np.int64)
    cu = np.asarray(cu_q_lens).astype(np.int64)
    n = int(np.asarray(num_seqs).reshape(()))
    if not 0 <= n <= max_num_seqs:
        raise ValueError(f"num_seqs={n} must be in [0, max_num_seqs={max_num_seqs}]")
    if cu[0] != 0 or np.any(np.diff(cu[: n + 1]) < 0):
        raise ValueError("cu_q_lens must start at 0 and be non-decreasing over the first num_seqs + 1 entries")
    if cu[n] > num_tokens:
        raise ValueError(f"cu_q_lens[num_seqs]={cu[n]} exceeds the number of query rows {num_tokens}")
    q_lens = np.diff(cu[: n + 1])
    if np.any(kv[:n] < q_lens):
        bad = int(np.argmax(kv[:n] < q_lens))
        raise ValueError(f"sequence {bad}: kv_lens={kv[bad]} is shorter than its query length {q_lens[bad]}")
    capacity = block_tables.shape[1] * block_size
    if n and kv[:n].max() > capacity:
        bad = int(np.argmax(kv[:n]))
        raise ValueError(
            f"sequence {bad}: kv_lens={kv[bad]} needs {-(-int(kv[bad]) // block_size)} blocks but block_tables "
            f"has only max_blocks_per_seq={block_tables.shape[1]} (capacity {capacity} tokens)"
        )


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "config"))
def _ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale,
                            interpret, config: KernelConfig):
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_pages.shape
    max_num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    g_pad = _next_pow2(group)
    dec, pre = config.decode, config.prefill
    num_splits = config.max_splits
    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)

    max_dec, max_pre = tiles.max_tiles(num_tokens=num_tokens, max_num_seqs=max_num_seqs,
                                       decode_block_q=dec.block_q, prefill_block_q=pre.block_q)
    dec_block_kv = dec.kv_pages_per_block * block_size
    meta_dec, meta_pre = tiles.tile_metadata(
        kv_lens, cu_q_lens, num_seqs, num_tokens=num_tokens, decode_block_q=dec.block_q,
        prefill_block_q=pre.block_q, max_decode_tiles=max_dec, max_prefill_tiles=max_pre,
        max_kv_len=max_blocks * block_size, decode_block_kv=dec_block_kv, max_splits=num_splits,
        min_split_steps=max(1, _cdiv(config.min_split_kv, dec_block_kv)),
        split_target_programs=config.split_target_programs, num_kv_heads=num_kv_heads,
    )
    # Whole KV steps of either tile kind never read past the (padded) block table.
    step_pages = max(dec.kv_pages_per_block if max_dec else 1, pre.kv_pages_per_block)
    padded_blocks = _cdiv(max_blocks, step_pages) * step_pages
    if padded_blocks != max_blocks:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, padded_blocks - max_blocks)))

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if g_pad != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, g_pad - group), (0, 0)))

    def kernel(tile: TileConfig, mode: str):
        return functools.partial(
            _attention_kernel, sm_scale=float(sm_scale), block_q=tile.block_q,
            num_kv_pages_per_block=tile.kv_pages_per_block, num_blocks=num_blocks, mask_value=DEFAULT_MASK_VALUE,
            mode=mode,
        )

    def params(tile: TileConfig):
        return plgpu.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages)

    def full(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    per_head_q = pl.BlockSpec((num_tokens, None, g_pad, head_dim), lambda t, h, *_: (0, h, 0, 0))
    per_head_kv = pl.BlockSpec((num_blocks, block_size, None, head_dim), lambda t, h, *_: (0, 0, h, 0))
    out_shape = jax.ShapeDtypeStruct(qg.shape, q.dtype)
    common_specs = [full(block_tables.shape), per_head_q, per_head_kv, per_head_kv]

    # 1. Prefill tiles and the zero tiles of the padding rows; decode rows are left for step 2.
    out = pl.pallas_call(
        kernel(pre, "direct"), grid=(max_pre, num_kv_heads), in_specs=[full(meta_pre.shape)] + common_specs,
        out_specs=per_head_q, out_shape=out_shape, interpret=interpret, compiler_params=params(pre),
        name=f"rpa_prefill_bq{pre.block_q}_kvp{pre.kv_pages_per_block}",
    )(meta_pre, block_tables, qg, k_pages, v_pages)

    # 2. Decode tiles, written into the same buffer (aliased): directly, or as KV splits and a merge.
    if max_dec and num_splits == 1:
        out = pl.pallas_call(
            kernel(dec, "aliased"), grid=(max_dec, num_kv_heads),
            in_specs=[full(meta_dec.shape)] + common_specs + [per_head_q], out_specs=per_head_q,
            out_shape=out_shape, input_output_aliases={5: 0}, interpret=interpret, compiler_params=params(dec),
            name=f"rpa_decode_bq{dec.block_q}_kvp{dec.kv_pages_per_block}",
        )(meta_dec, block_tables, qg, k_pages, v_pages, out)
    elif max_dec:
        rows = dec.block_q * g_pad
        part = lambda *s: jax.ShapeDtypeStruct((num_splits, max_dec, num_kv_heads, *s), jnp.float32)
        part_spec = lambda *s: pl.BlockSpec((None, None, None, *s), lambda t, h, i: (i, t, h) + (0,) * len(s))
        out, acc, m, l = pl.pallas_call(
            kernel(dec, "partial"), grid=(max_dec, num_kv_heads, num_splits),
            in_specs=[full(meta_dec.shape)] + common_specs + [per_head_q],
            out_specs=[per_head_q, part_spec(rows, head_dim), part_spec(rows), part_spec(rows)],
            out_shape=[out_shape, part(rows, head_dim), part(rows), part(rows)], input_output_aliases={5: 0},
            interpret=interpret, compiler_params=params(dec),
            name=f"rpa_decode_split{num_splits}_bq{dec.block_q}_kvp{dec.kv_pages_per_block}",
        )(meta_dec, block_tables, qg, k_pages, v_pages, out)
        all_splits = lambda *s: pl.BlockSpec((num_splits, None, None, *s), lambda t, h: (0, t, h) + (0,) * len(s))
        out = pl.pallas_call(
            functools.partial(_merge_kernel, block_q=dec.block_q, mask_value=DEFAULT_MASK_VALUE),
            grid=(max_dec, num_kv_heads),
            in_specs=[full(meta_dec.shape), all_splits(rows, head_dim), all_splits(rows), all_splits(rows),
                      per_head_q],
            out_specs=per_head_q, out_shape=out_shape, input_output_aliases={4: 0}, interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
            name=f"rpa_merge_split{num_splits}_bq{dec.block_q}",
        )(meta_dec, acc, m, l, out)

    if g_pad != group:
        out = out[:, :, :group, :]
    return out.reshape(num_tokens, num_q_heads, head_dim)


def resolve_kernel_config(
    q_shape, k_pages_shape, block_tables_shape, dtype, *, config: KernelConfig | None = None,
    block_q: int | None = None, num_kv_pages_per_block: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, num_kv_splits: int | None = None,
) -> tuple[KernelConfig, str]:
    """The static `KernelConfig` a call with these shapes uses, and where it came from (tuning-table entry
    or rules; see `pallas_kernels/tuning.py`). Explicit arguments override it: `block_q` the prefill
    tiles' query rows, `num_kv_pages_per_block`, `num_warps` and `num_stages` both tile kinds, and
    `num_kv_splits` the static split bound (1: no split-KV pass)."""
    num_tokens, num_q_heads, head_dim = q_shape
    _, block_size, num_kv_heads, _ = k_pages_shape
    g_pad = _next_pow2(num_q_heads // num_kv_heads)
    source = "explicit config"
    if config is None:
        config, source = resolve_config(
            dtype=jnp.dtype(dtype).name, head_dim=head_dim, group=g_pad, block_size=block_size,
            tokens=num_tokens, max_context=block_tables_shape[1] * block_size,
        )
    overrides = dict(block_q=block_q, kv_pages_per_block=num_kv_pages_per_block, num_warps=num_warps,
                     num_stages=num_stages)
    if any(v is not None for v in overrides.values()) or num_kv_splits is not None:
        source += " + explicit " + ", ".join(
            k for k, v in dict(overrides, num_kv_splits=num_kv_splits).items() if v is not None)
    both = {k: v for k, v in overrides.items() if v is not None and k != "block_q"}
    config = KernelConfig(
        decode=TileConfig(**{**config.decode.__dict__, **both}),
        prefill=TileConfig(**{**config.prefill.__dict__, **both, **({"block_q": block_q} if block_q else {})}),
        max_splits=config.max_splits if num_kv_splits is None else num_kv_splits,
        min_split_kv=config.min_split_kv,
        split_target_programs=config.split_target_programs,
    )
    return config, source


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    num_kv_pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_kv_splits: int | None = None,
    config: KernelConfig | None = None,
) -> jax.Array:
    """Ragged paged attention (flash-style, GQA-grouped, split-KV for decodes) as Pallas kernels.

    Args:
      q: [num_tokens, num_q_heads, head_dim] queries of all scheduled tokens, sequence after sequence,
        padded to a fixed bucket size.
      k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim] paged KV cache of one layer; same
        dtype as q (float32, bfloat16 or float16).
      kv_lens: int32[max_num_seqs] tokens of each sequence in the cache, including this step's.
      block_tables: int32[max_num_seqs, max_blocks_per_seq] page ids of each sequence.
      cu_q_lens: int32[max_num_seqs + 1] query row offsets; sequence i owns rows cu_q_lens[i]:cu_q_lens[i+1].
      num_seqs: int32 scalar or int32[1], number of real sequences; the rest are padding.
      sm_scale: softmax scale (static); defaults to head_dim ** -0.5.
      interpret: run through the Pallas interpreter (static); required on CPU.
      block_q: query rows per prefill tile (static, power of two, block_q * next_pow2(group) >= 16).
      num_kv_pages_per_block: pages per KV step of both tile kinds (static, power of two, times block_size
        >= 16).
      num_warps, num_stages: Triton compiler parameters of both tile kinds (static).
      num_kv_splits: static bound on the KV splits of a decode tile (power of two; 1 disables split-KV).
      config: the full static `KernelConfig` (both tile kinds and the split parameters). When None, it
        comes from the tuning table, or the rules where the table has no entry (`resolve_kernel_config`);
        the arguments above override single fields of it.

    Returns:
      [num_tokens, num_q_heads, head_dim] in q.dtype. Row r of sequence i holds softmax(q k^T * sm_scale) v
      over positions 0 .. kv_lens[i] - q_len_i + (r - cu_q_lens[i]) of that sequence; rows at or past
      cu_q_lens[num_seqs] are zeros.

    Raises:
      ValueError: on inconsistent shapes or dtypes, bad block sizes, and (only when the metadata are
        concrete, i.e. not traced) on metadata values the cache cannot hold, such as a kv_len larger than
        max_blocks_per_seq * block_size.

    See the module docstring for the grids and what each program does.
    """
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    kv_lens = kv_lens if isinstance(kv_lens, jax.Array) else jnp.asarray(kv_lens)
    block_tables = block_tables if isinstance(block_tables, jax.Array) else jnp.asarray(block_tables)
    cu_q_lens = cu_q_lens if isinstance(cu_q_lens, jax.Array) else jnp.asarray(cu_q_lens)
    num_seqs = num_seqs if isinstance(num_seqs, jax.Array) else jnp.asarray(num_seqs)
    _validate_shapes(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, interpret=interpret)
    config, _ = resolve_kernel_config(
        q.shape, k_pages.shape, block_tables.shape, q.dtype, config=config, block_q=block_q,
        num_kv_pages_per_block=num_kv_pages_per_block, num_warps=num_warps, num_stages=num_stages,
        num_kv_splits=num_kv_splits,
    )
    _validate_config(config, group_pad=_next_pow2(q.shape[1] // k_pages.shape[2]), block_size=k_pages.shape[1])
    _validate_values(q, k_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    return _ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=float(sm_scale), interpret=bool(interpret), config=config,
    )
