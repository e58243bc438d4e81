"""Ragged paged attention as a Pallas kernel (GPU / Triton backend, or interpret mode anywhere).

Same arguments, shapes and semantics as `ragged_paged_attention_xla` (see that module and
`docs/design.md`), so the engine can swap one for the other; the float64 numpy reference of those semantics is
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
0 .. kv_lens[i] - q_len_i + j of the same sequence.

How the work is split
---------------------
The query rows of every sequence are cut into *query tiles* of at most `block_q` rows; a tile never spans
two sequences. A handful of cheap jnp ops outside the kernel (on `[max_num_seqs]`-sized metadata) number
the tiles of all sequences consecutively, followed by "zero tiles" that cover the padding rows
`cu_q_lens[num_seqs] .. T`. The number of tiles is data dependent but bounded by the static

    max_tiles = cdiv(T, block_q) + min(max_num_seqs, T) + 1

The kernel grid is `(max_tiles, num_kv_heads)`. Grid step `(t, h)`:

  * reads its tile's metadata (kind, sequence, first row, row limit, first query position, KV extent) with
    scalar loads from an ordinary int32 input;
  * kind 0 (unused tile): does nothing;
  * kind 2 (zero tile): stores zeros to its padding rows (masked store, so rows >= T are never touched);
  * kind 1 (compute tile): loads the `block_q x G` query rows of the `G = num_q_heads // num_kv_heads` query
    heads that share KV head `h` as one `[block_q * G_pad, head_dim]` matrix (GQA: each KV page is read
    once for the whole group; `G_pad = next_power_of_2(G)`, padded with zero heads in the wrapper only when
    G is not a power of two). It then runs a `lax.fori_loop` over KV blocks of `num_kv_pages_per_block`
    pages, *only up to the last position the tile's last query row may see* (so no work for blocks past
    the sequence's length or causally in the future). Each iteration reads the page ids from
    `block_tables`, gathers the pages' K and V for head `h`, and folds them into an online softmax
    (running max / sum / accumulator, all float32; scores in float32; the probabilities are cast to the
    value dtype for the second matmul, as in flash attention; float32 inputs use full-precision IEEE
    matmuls, not Triton's TF32 default). Finally it stores the rows that belong to
    the tile with a masked store, so rows of neighbouring sequences are never clobbered.

Every output row is written by the kernel (valid rows by compute tiles, padding rows by zero tiles), so
the output buffer needs no initialisation. Keys/values at positions a query may not see are masked in the
scores *and* zeroed in V, so stale or non-finite data in unused cache slots cannot leak into the output.

Block-size constraints
----------------------
`block_q` and `num_kv_pages_per_block` must be powers of two, `block_q * G_pad >= 16` and
`num_kv_pages_per_block * block_size >= 16` (Triton's `tt.dot` needs every matmul dim >= 16). For the
compiled Triton path (`interpret=False`) `block_size` and `head_dim` must also be powers of two and
`head_dim >= 16` (Triton tensors have power-of-two sizes); interpret mode does not need these two.

Limitations
-----------
There is no split over the KV length (flash-decoding): one program walks a sequence's whole context, so a
batch of a few very long sequences keeps only `num_seqs * num_kv_heads` programs busy. Decode tiles use a
`block_q * G_pad`-row matmul of which only `G` rows are real (harmless while decode is memory bound). The
default block sizes are not tuned.

Static arguments: `sm_scale`, `interpret`, `block_q`, `num_kv_pages_per_block`, `num_warps`,
`num_stages` (all keyword-only; the function is wrapped in `jax.jit` with these static).

Backends
--------
* GPU: lowers through Pallas's Triton backend (`jax.experimental.pallas.triton`); no TPU-only primitives
  and no scalar prefetch are used.
* CPU (or anywhere): `interpret=True` runs the same kernel body through the Pallas interpreter (slow;
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

__all__ = ["ragged_paged_attention", "DEFAULT_MASK_VALUE"]

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Rows of the int32 tile-metadata array passed to the kernel.
_KIND, _SEQ, _ROW0, _ROW_END, _POS0, _KV_END = range(6)
_NUM_META = 6
_KIND_EMPTY, _KIND_COMPUTE, _KIND_ZERO = 0, 1, 2

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _cdiv(a, b):
    return (a + b - 1) // b


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _kernel(
    meta_ref,  # int32[_NUM_META, max_tiles]
    block_tables_ref,  # int32[max_num_seqs, max_blocks_per_seq_padded]
    q_ref,  # [T, G_pad, head_dim]            (KV head squeezed by the BlockSpec)
    k_ref,  # [num_blocks, block_size, head_dim]
    v_ref,  # [num_blocks, block_size, head_dim]
    o_ref,  # [T, G_pad, head_dim]
    *,
    sm_scale: float,
    block_q: int,
    num_kv_pages_per_block: int,
    num_blocks: int,
    mask_value: float,
):
    t = pl.program_id(0)
    _, g_pad, head_dim = q_ref.shape
    block_size = k_ref.shape[1]
    block_kv = num_kv_pages_per_block * block_size
    rows = block_q * g_pad

    kind = meta_ref[_KIND, t]
    row0 = meta_ref[_ROW0, t]
    row_end = meta_ref[_ROW_END, t]
    # Rows [row0, row_end) of this tile are ours; mask for a [block_q, g_pad, head_dim] tile.
    row_ids = lax.broadcasted_iota(jnp.int32, (block_q, g_pad, head_dim), 0)
    row_mask = row_ids < (row_end - row0)

    @pl.when(kind == _KIND_ZERO)
    def _zero():
        plgpu.store(
            o_ref.at[pl.ds(row0, block_q)], jnp.zeros((block_q, g_pad, head_dim), o_ref.dtype), mask=row_mask
        )

    @pl.when(kind == _KIND_COMPUTE)
    def _compute():
        seq = meta_ref[_SEQ, t]
        pos0 = meta_ref[_POS0, t]  # position of the tile's first query row
        kv_end = meta_ref[_KV_END, t]  # KV positions [0, kv_end) are visible to some row of the tile

        # float32 inputs: full-precision (IEEE) matmuls; Triton's default for float32 would be TF32.
        precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
        q = plgpu.load(q_ref.at[pl.ds(row0, block_q)], mask=row_mask, other=0)
        q = q.reshape(rows, head_dim)
        # Query position of each of the block_q * g_pad matrix rows (row r is query r // g_pad).
        q_pos = pos0 + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) // g_pad
        kv_iota = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        kv_iota_1d = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
        page_iota = lax.broadcasted_iota(jnp.int32, (num_kv_pages_per_block,), 0)
        num_pages = _cdiv(kv_end, block_size)

        def body(b, carry):
            m_prev, l_prev, acc_prev = carry
            first_page = b * num_kv_pages_per_block
            pages = block_tables_ref[seq, pl.ds(first_page, num_kv_pages_per_block)]
            # Pages past the sequence's end may hold anything: point them at page 0 (their scores are
            # masked and their values zeroed below) and never index outside the cache.
            pages = jnp.where(page_iota + first_page < num_pages, pages, 0)
            pages = jnp.clip(pages, 0, num_blocks - 1)
            k = k_ref[pages].reshape(block_kv, head_dim)
            v = v_ref[pages].reshape(block_kv, head_dim)

            kv_start = b * block_kv
            s = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )  # [rows, block_kv]
            s = s * sm_scale
            kv_pos = kv_start + kv_iota
            visible = (kv_pos <= q_pos) & (kv_pos < kv_end)
            s = jnp.where(visible, s, mask_value)
            m_cur = jnp.max(s, axis=1)
            m_next = jnp.maximum(m_prev, m_cur)
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next[:, None])
            p = jnp.where(visible, p, 0.0)
            l_next = l_prev * alpha + jnp.sum(p, axis=1)
            v = jnp.where(kv_start + kv_iota_1d < kv_end, v, jnp.zeros_like(v))
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                preferred_element_type=jnp.float32,
            )  # [rows, head_dim]
            acc_next = acc_prev * alpha[:, None] + pv
            return m_next, l_next, acc_next

        init = (
            jnp.full((rows,), mask_value, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        )
        _, l, acc = lax.fori_loop(0, _cdiv(kv_end, block_kv), body, init)
        l = jnp.where(l > 0.0, l, 1.0)
        out = (acc / l[:, None]).astype(o_ref.dtype).reshape(block_q, g_pad, head_dim)
        plgpu.store(o_ref.at[pl.ds(row0, block_q)], out, mask=row_mask)


def _tile_metadata(kv_lens, cu_q_lens, num_seqs, *, num_tokens, block_q, max_tiles, max_kv_len):
    """int32[_NUM_META, max_tiles]: which rows each query tile covers and how much KV it needs."""
    max_num_seqs = kv_lens.shape[0]
    seq_ids = jnp.arange(max_num_seqs, dtype=jnp.int32)
    seq_valid = seq_ids < num_seqs
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    q_lens = jnp.maximum(q_lens, 0)
    tiles_per_seq = _cdiv(q_lens, block_q)
    tile_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)  # exclusive end of each sequence's tiles
    num_compute = tile_end[-1]
    pad_start = jnp.minimum(cu_q_lens[num_seqs], num_tokens)
    num_zero = _cdiv(num_tokens - pad_start, block_q)

    t = jnp.arange(max_tiles, dtype=jnp.int32)
    seq = jnp.sum(tile_end[None, :] <= t[:, None], axis=1).astype(jnp.int32)
    seq = jnp.minimum(seq, max_num_seqs - 1)
    local = t - (tile_end[seq] - tiles_per_seq[seq])
    is_compute = t < num_compute
    is_zero = (~is_compute) & (t - num_compute < num_zero)
    kind = jnp.where(is_compute, _KIND_COMPUTE, jnp.where(is_zero, _KIND_ZERO, _KIND_EMPTY))

    seq_start = cu_q_lens[seq]
    seq_end = cu_q_lens[seq + 1]
    row0 = jnp.where(is_compute, seq_start + local * block_q, pad_start + (t - num_compute) * block_q)
    row_end = jnp.where(is_compute, seq_end, num_tokens)
    kv_len = jnp.minimum(kv_lens[seq], max_kv_len)
    context = kv_len - (seq_end - seq_start)
    pos0 = context + (row0 - seq_start)
    last_row = jnp.minimum(row0 + block_q, row_end)  # exclusive
    kv_end = jnp.clip(context + (last_row - seq_start), 0, kv_len)
    zeros = jnp.zeros_like(t)
    meta = [
        kind,
        jnp.where(is_compute, seq, zeros),
        jnp.where(is_compute | is_zero, row0, zeros),
        jnp.where(is_compute | is_zero, row_end, zeros),
        jnp.where(is_compute, pos0, zeros),
        jnp.where(is_compute, kv_end, zeros),
    ]
    return jnp.stack([x.astype(jnp.int32) for x in meta])


def _validate(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, block_q, num_kv_pages_per_block, interpret):
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
    for name, x in (("kv_lens", kv_lens), ("block_tables", block_tables), ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {x.dtype}")

    group = num_q_heads // num_kv_heads
    g_pad = _next_pow2(group)
    if not _is_pow2(block_q):
        raise ValueError(f"block_q={block_q} must be a power of two")
    if block_q * g_pad < 16:
        raise ValueError(
            f"block_q * next_power_of_2(num_q_heads // num_kv_heads) = {block_q} * {g_pad} must be >= 16"
        )
    if not _is_pow2(num_kv_pages_per_block):
        raise ValueError(f"num_kv_pages_per_block={num_kv_pages_per_block} must be a power of two")
    if num_kv_pages_per_block * block_size < 16:
        raise ValueError(
            f"num_kv_pages_per_block * block_size = {num_kv_pages_per_block} * {block_size} must be >= 16"
        )
    if not interpret:
        if not _is_pow2(block_size):
            raise ValueError(f"the Triton path needs a power-of-two block_size, got {block_size}")
        if not _is_pow2(head_dim) or head_dim < 16:
            raise ValueError(f"the Triton path needs a power-of-two head_dim >= 16, got {head_dim}")

    # Value checks, only where the metadata is concrete (not traced under jit).
    if all(_is_concrete(x) for x in (kv_lens, cu_q_lens, num_seqs)):
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


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "interpret", "block_q", "num_kv_pages_per_block", "num_warps", "num_stages"),
)
def _ragged_paged_attention(
    q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale, interpret, block_q,
    num_kv_pages_per_block, num_warps, num_stages,
):
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_pages.shape
    max_num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    g_pad = _next_pow2(group)
    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)

    max_tiles = _cdiv(num_tokens, block_q) + min(max_num_seqs, num_tokens) + 1
    meta = _tile_metadata(
        kv_lens, cu_q_lens, num_seqs, num_tokens=num_tokens, block_q=block_q, max_tiles=max_tiles,
        max_kv_len=max_blocks * block_size,
    )
    padded_blocks = _cdiv(max_blocks, num_kv_pages_per_block) * num_kv_pages_per_block
    if padded_blocks != max_blocks:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, padded_blocks - max_blocks)))

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if g_pad != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, g_pad - group), (0, 0)))

    kernel = functools.partial(
        _kernel,
        sm_scale=float(sm_scale),
        block_q=block_q,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_blocks=num_blocks,
        mask_value=DEFAULT_MASK_VALUE,
    )
    grid = (max_tiles, num_kv_heads)
    full = lambda shape: pl.BlockSpec(shape, lambda t, h: (0,) * len(shape))
    per_head_q = pl.BlockSpec((num_tokens, None, g_pad, head_dim), lambda t, h: (0, h, 0, 0))
    per_head_kv = pl.BlockSpec((num_blocks, block_size, None, head_dim), lambda t, h: (0, 0, h, 0))
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[full(meta.shape), full(block_tables.shape), per_head_q, per_head_kv, per_head_kv],
        out_specs=per_head_q,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"ragged_paged_attention_bq{block_q}_kvp{num_kv_pages_per_block}",
    )(meta, block_tables, qg, k_pages, v_pages)
    if g_pad != group:
        out = out[:, :, :group, :]
    return out.reshape(num_tokens, num_q_heads, head_dim)


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
) -> jax.Array:
    """Ragged paged attention (flash-style, GQA-grouped) as a Pallas kernel.

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
      block_q: query rows per tile (static, power of two, block_q * next_pow2(group) >= 16); default
        max(1, 64 // next_pow2(group)).
      num_kv_pages_per_block: pages per KV step (static, power of two, times block_size >= 16); default
        the largest power of two with num_kv_pages_per_block * block_size <= 64 (raised to reach 16).
      num_warps, num_stages: Triton compiler parameters (static); Pallas defaults when None.

    Returns:
      [num_tokens, num_q_heads, head_dim] in q.dtype. Row r of sequence i holds softmax(q k^T * sm_scale) v
      over positions 0 .. kv_lens[i] - q_len_i + (r - cu_q_lens[i]) of that sequence; rows at or past
      cu_q_lens[num_seqs] are zeros.

    Raises:
      ValueError: on inconsistent shapes or dtypes, bad block sizes, and (only when the metadata are
        concrete, i.e. not traced) on metadata values the cache cannot hold, such as a kv_len larger than
        max_blocks_per_seq * block_size.

    See the module docstring for the grid and what each grid step does.
    """
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    kv_lens = kv_lens if isinstance(kv_lens, jax.Array) else jnp.asarray(kv_lens)
    block_tables = block_tables if isinstance(block_tables, jax.Array) else jnp.asarray(block_tables)
    cu_q_lens = cu_q_lens if isinstance(cu_q_lens, jax.Array) else jnp.asarray(cu_q_lens)
    num_seqs = num_seqs if isinstance(num_seqs, jax.Array) else jnp.asarray(num_seqs)
    if q.ndim == 3 and k_pages.ndim == 4 and k_pages.shape[2] and q.shape[1] % k_pages.shape[2] == 0:
        g_pad = _next_pow2(q.shape[1] // k_pages.shape[2])
        if block_q is None:
            block_q = max(1, 64 // g_pad)
        if num_kv_pages_per_block is None and k_pages.shape[1]:
            # The largest power of two with num_kv_pages_per_block * block_size <= 64, but at least 16 tokens.
            num_kv_pages_per_block = 1 << (max(1, 64 // k_pages.shape[1]).bit_length() - 1)
            while num_kv_pages_per_block * k_pages.shape[1] < 16:
                num_kv_pages_per_block *= 2
    block_q = 16 if block_q is None else int(block_q)
    num_kv_pages_per_block = 1 if num_kv_pages_per_block is None else int(num_kv_pages_per_block)
    _validate(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        block_q=block_q, num_kv_pages_per_block=num_kv_pages_per_block, interpret=interpret,
    )
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    return _ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=float(sm_scale), interpret=bool(interpret), block_q=block_q,
        num_kv_pages_per_block=num_kv_pages_per_block, num_warps=num_warps, num_stages=num_stages,
    )
