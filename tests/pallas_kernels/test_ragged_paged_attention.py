"""Ragged paged attention: the Pallas kernel (interpret mode on CPU) and the jnp path against the float64
numpy reference beside them (`pallas_kernels/reference.py`), which shares no code with either.

Error measure: rel_err = max|out - ref| / max|ref| over all valid rows (a max-norm relative error);
bounds 1e-5 for float32 and 2e-2 for bfloat16 inputs.

Poisoning: the Pallas interpreter initialises kernel outputs with NaN (checked by
`test_interpreter_poisons_unwritten_outputs`), so "no NaN in the output" means the kernel wrote every row.
Inputs are poisoned as well: padding query rows, cache pages no sequence owns, cache slots past a
sequence's kv_len, and block-table entries past a sequence's last block (which point at random pages,
often NaN ones). Padding rows must come out exactly zero.

Shapes are fixed per configuration (one compile each); hypothesis varies the ragged metadata and data.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import get_attention_fn, ragged_paged_attention, ragged_paged_attention_xla
from pallas_kernels.ragged_paged_attention import KernelConfig, TileConfig, _next_pow2, resolve_kernel_config
from pallas_kernels import ragged_paged_attention_tiles as tiles
from pallas_kernels.reference import ragged_paged_attention_reference as reference

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
NUM_TOKENS = 64  # T, the padded token budget
MAX_NUM_SEQS = 5
CAPACITY = 128  # max_blocks_per_seq * block_size


@dataclasses.dataclass(frozen=True)
class Cfg:
    dtype: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    block_q: int | None = None  # None: the kernel's default
    num_kv_pages_per_block: int | None = None
    config: KernelConfig | None = None  # a full static config (decode tiles, splits), instead of the two above

    @property
    def max_blocks(self):
        return CAPACITY // self.block_size

    @property
    def num_blocks(self):
        return MAX_NUM_SEQS * self.max_blocks + 3

    def __str__(self):
        g = self.num_q_heads // self.num_kv_heads
        return (
            f"{self.dtype}-g{g}-hkv{self.num_kv_heads}-d{self.head_dim}-bs{self.block_size}"
            f"-bq{self.block_q}-kvp{self.num_kv_pages_per_block}" + (f"-{_cfg_id(self.config)}" if self.config else "")
        )


def _cfg_id(c: KernelConfig) -> str:
    return (f"dec{c.decode.block_q}x{c.decode.kv_pages_per_block}-pre{c.prefill.block_q}x{c.prefill.kv_pages_per_block}"
            f"-s{c.max_splits}-min{c.min_split_kv}-tp{c.split_target_programs}")


def _split_cfg(decode_bq, decode_kvp, prefill_bq, prefill_kvp, max_splits, min_split_kv=16, target=10**6):
    return KernelConfig(decode=TileConfig(decode_bq, decode_kvp), prefill=TileConfig(prefill_bq, prefill_kvp),
                        max_splits=max_splits, min_split_kv=min_split_kv, split_target_programs=target)


# GQA ratios 1, 2, 3 (not a power of two: padded group), 4, 8; head_dim 64 and 128; block sizes 16 and 32;
# small query tiles so sequences span several tiles, and small KV blocks so the KV loop runs several times.
CONFIGS = [
    Cfg("float32", 2, 2, 64, 16, block_q=16, num_kv_pages_per_block=1),
    Cfg("float32", 4, 2, 128, 32, block_q=8, num_kv_pages_per_block=1),
    Cfg("float32", 3, 1, 64, 16, block_q=4, num_kv_pages_per_block=2),
    Cfg("float32", 8, 1, 64, 32),  # default block sizes
    Cfg("bfloat16", 8, 2, 64, 32, block_q=4, num_kv_pages_per_block=1),
    Cfg("bfloat16", 8, 1, 128, 16, block_q=2, num_kv_pages_per_block=2),
    Cfg("bfloat16", 2, 1, 128, 16),  # default block sizes
    # Split-KV decode tiles (and decode tiles holding short chunks of up to decode block_q rows): KV steps of
    # 16-32 tokens, at most 4 or 8 splits of at least one step each, so decodes split into up to 8 parts
    # (CAPACITY = 128). A huge split target splits as far as the bounds allow; target 8 makes the number of
    # splits depend on how many decode tiles the batch has.
    Cfg("float32", 4, 2, 64, 16, config=_split_cfg(8, 1, 16, 2, max_splits=4)),
    Cfg("float32", 3, 1, 64, 16, config=_split_cfg(4, 2, 8, 1, max_splits=8, target=8)),
    Cfg("bfloat16", 8, 2, 128, 16, config=_split_cfg(4, 1, 4, 2, max_splits=8)),
    Cfg("bfloat16", 4, 4, 64, 32, config=_split_cfg(16, 1, 32, 1, max_splits=2, min_split_kv=64)),
    # Decode tiles without splits (aliased direct write), and decode tiles disabled (prefill tiles only).
    Cfg("float32", 4, 2, 64, 16, config=_split_cfg(8, 2, 16, 1, max_splits=1)),
    Cfg("float32", 4, 2, 64, 16, config=_split_cfg(0, 1, 8, 4, max_splits=1)),
]


@dataclasses.dataclass
class Batch:
    q_lens: list[int]
    ctx_lens: list[int]  # tokens already in the cache before this step


def make_inputs(cfg: Cfg, batch: Batch, seed: int):
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(cfg.dtype)
    n = len(batch.q_lens)
    kv_lens = np.zeros(MAX_NUM_SEQS, np.int32)
    cu_q_lens = np.zeros(MAX_NUM_SEQS + 1, np.int32)
    for i, (ql, ctx) in enumerate(zip(batch.q_lens, batch.ctx_lens)):
        kv_lens[i] = ql + ctx
        cu_q_lens[i + 1] = cu_q_lens[i] + ql
    cu_q_lens[n + 1 :] = cu_q_lens[n]
    assert cu_q_lens[n] <= NUM_TOKENS and kv_lens.max() <= CAPACITY

    shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    k_pages = np.full(shape, np.nan, np.float32)
    v_pages = np.full(shape, np.nan, np.float32)
    # Garbage entries (past each sequence's last block) point at random pages, often unowned NaN pages.
    block_tables = rng.integers(0, cfg.num_blocks, (MAX_NUM_SEQS, cfg.max_blocks)).astype(np.int32)
    free = list(rng.permutation(cfg.num_blocks))  # shuffled: non-contiguous block tables
    for i in range(n):
        kv_len = int(kv_lens[i])
        for b in range(-(-kv_len // cfg.block_size)):
            page = free.pop()
            block_tables[i, b] = page
            used = min(cfg.block_size, kv_len - b * cfg.block_size)
            # Slots past kv_len in the last page stay NaN.
            k_pages[page, :used] = rng.standard_normal((used, cfg.num_kv_heads, cfg.head_dim))
            v_pages[page, :used] = rng.standard_normal((used, cfg.num_kv_heads, cfg.head_dim))
    q = rng.standard_normal((NUM_TOKENS, cfg.num_q_heads, cfg.head_dim)).astype(np.float32)
    q[cu_q_lens[n] :] = np.nan  # padding rows
    # Round to the input dtype first so that the reference sees exactly what the kernels see.
    q, k_pages, v_pages = (np.asarray(jnp.asarray(x, dtype)) for x in (q, k_pages, v_pages))
    return q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, np.array([n], np.int32)


@functools.cache
def _xla_jitted():
    return jax.jit(ragged_paged_attention_xla)


def run_kernel(cfg: Cfg, args):
    return ragged_paged_attention(
        *args, interpret=True, block_q=cfg.block_q, num_kv_pages_per_block=cfg.num_kv_pages_per_block,
        config=cfg.config,
    )


def check(cfg: Cfg, batch: Batch, seed: int, *, paths=("pallas", "xla")):
    args = make_inputs(cfg, batch, seed)
    q, *_, cu_q_lens, num_seqs = args
    n = int(num_seqs[0])
    ref = reference(*args, sm_scale=cfg.head_dim**-0.5)
    end = int(cu_q_lens[n])
    for path in paths:
        out = run_kernel(cfg, args) if path == "pallas" else _xla_jitted()(*args)
        assert out.shape == q.shape and out.dtype == q.dtype, path
        out = np.asarray(out, np.float64)
        assert not np.isnan(out).any(), f"{path}: NaN in output (a row was not written, or poison leaked)"
        assert np.all(out[end:] == 0.0), f"{path}: padding rows are not exactly zero"
        if end:
            err = np.abs(out[:end] - ref[:end]).max() / max(np.abs(ref[:end]).max(), 1e-30)
            assert err <= TOL[cfg.dtype], f"{path} {cfg} {batch}: rel_err={err:.3g}"


@st.composite
def batches(draw, cfg: Cfg, mode: str):
    """Random ragged batch: `mode` is decode, prefill (no prior context), or mixed (decodes, prefills and
    chunks with prior context, in random order)."""
    n = draw(st.integers(1, MAX_NUM_SEQS))
    q_lens, ctx_lens = [], []
    budget = NUM_TOKENS
    for _ in range(n):
        if budget == 0:
            break
        kind = mode if mode != "mixed" else draw(st.sampled_from(["decode", "prefill", "chunk"]))
        if kind == "decode":
            ql, ctx = 1, draw(st.integers(0, CAPACITY - 1))
        elif kind == "prefill":
            ql, ctx = draw(st.integers(1, budget)), 0
        else:
            ql = draw(st.integers(1, budget))
            ctx = draw(st.integers(1, CAPACITY - ql))
        q_lens.append(ql)
        ctx_lens.append(ctx)
        budget -= ql
    return Batch(q_lens, ctx_lens)


HYPO = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@pytest.mark.parametrize("mode", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_random_batches(cfg, mode):
    @HYPO
    @given(batch=batches(cfg, mode), seed=st.integers(0, 2**31 - 1))
    def inner(batch, seed):
        check(cfg, batch, seed)

    inner()


EDGE_CASES = {
    # A chunk of 30 with 10 tokens of context crosses page boundaries for both block sizes.
    "chunk_crosses_pages": Batch([30, 1], [10, 40]),
    # kv_len an exact multiple of the block size (16 and 32): full last page, decode and chunk.
    "kv_len_multiple_of_block": Batch([1, 32, 16], [63, 32, 48]),
    # One sequence filling the whole token budget, with context, up to the cache capacity.
    "one_seq_fills_budget": Batch([NUM_TOKENS], [CAPACITY - NUM_TOKENS]),
    "one_prefill_fills_budget": Batch([NUM_TOKENS], [0]),
    "all_decodes": Batch([1] * MAX_NUM_SEQS, [0, 15, 16, 17, CAPACITY - 1]),
    "num_seqs_0": Batch([], []),
    "ends_exactly_at_budget": Batch([1, 31, 32], [5, 0, 64]),
    # Sequences with no query rows this step (q_len 0) own no rows and produce nothing.
    "zero_q_len_seqs": Batch([3, 0, 1, 0, 2], [5, 10, 7, 0, 100]),
    # Decodes at the full capacity: every split of the longest KV range is used.
    "long_decodes_and_a_chunk": Batch([1, 1, 6, 40], [CAPACITY - 1, 100, 90, 20]),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[1], CONFIGS[4], CONFIGS[5], CONFIGS[7], CONFIGS[8],
                                 CONFIGS[9], CONFIGS[12]], ids=str)
def test_edge_cases(cfg, case):
    check(cfg, EDGE_CASES[case], seed=hash(case) % 1000)


@functools.cache
def _jitted_metadata(**static):
    return jax.jit(functools.partial(tiles.tile_metadata, max_kv_len=10**6, **static))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_tile_metadata_partitions_rows(data):
    """The decode and prefill tiles handed to the grids cover every row of [0, T) exactly once, a compute
    tile never spans two sequences, its KV extent is what its last row may see, a sequence's rows are all
    in decode tiles (1 <= q_len <= decode block_q) or all in prefill tiles, and a decode tile's KV splits
    cover its KV steps exactly, none empty, at most max_splits of them. (Interpret mode runs the grid in
    order, so an overlapping store could go unnoticed in the end-to-end tests; on a GPU it would race.)"""
    num_tokens, max_num_seqs, num_kv_heads = 40, 12, 2
    bq_d = data.draw(st.sampled_from([0, 1, 2, 4, 8]))
    bq_p = data.draw(st.sampled_from([1, 4, 16]))
    block_kv = data.draw(st.sampled_from([16, 32]))
    max_splits = data.draw(st.sampled_from([1, 2, 8]))
    min_steps = data.draw(st.sampled_from([1, 3]))
    target = data.draw(st.sampled_from([1, 16, 10**6]))
    q_lens = data.draw(st.lists(st.integers(0, 20), min_size=0, max_size=max_num_seqs))
    while sum(q_lens) > num_tokens:
        q_lens.pop()
    n = len(q_lens)
    ctx = data.draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    kv_lens = np.zeros(max_num_seqs, np.int32)
    kv_lens[:n] = np.array(q_lens, np.int64) + np.array(ctx, np.int64)
    cu = np.zeros(max_num_seqs + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    max_dec, max_pre = tiles.max_tiles(num_tokens=num_tokens, max_num_seqs=max_num_seqs, decode_block_q=bq_d,
                                       prefill_block_q=bq_p)
    fn = _jitted_metadata(num_tokens=num_tokens, decode_block_q=bq_d, prefill_block_q=bq_p,
                          max_decode_tiles=max_dec, max_prefill_tiles=max_pre, decode_block_kv=block_kv,
                          max_splits=max_splits, min_split_steps=min_steps, split_target_programs=target,
                          num_kv_heads=num_kv_heads)
    meta_dec, meta_pre = (np.asarray(m) for m in fn(kv_lens, cu, np.int32(n)))
    assert meta_dec.shape == (tiles.NUM_META, max_dec) and meta_pre.shape == (tiles.NUM_META, max_pre)
    covered = np.zeros(num_tokens, np.int64)
    seq_kind = {}
    for kind_name, meta, bq in (("decode", meta_dec, bq_d), ("prefill", meta_pre, bq_p)):
        kind, seq, row0, row_end, pos0, kv_end, num_splits, split_steps = meta
        for t in range(meta.shape[1]):
            if kind[t] == tiles.KIND_EMPTY:
                continue
            lo, hi = row0[t], min(row0[t] + bq, row_end[t])
            assert lo < hi <= num_tokens
            covered[lo:hi] += 1
            if kind[t] == tiles.KIND_COMPUTE:
                i = seq[t]
                assert i < n and cu[i] <= lo and hi <= cu[i + 1] == row_end[t]
                assert seq_kind.setdefault(i, kind_name) == kind_name
                assert (kind_name == "decode") == (1 <= q_lens[i] <= bq_d)
                assert pos0[t] == kv_lens[i] - q_lens[i] + (lo - cu[i])
                assert kv_end[t] == pos0[t] + (hi - lo)
                if kind_name == "decode":
                    assert lo == cu[i] and hi == cu[i + 1]  # one tile per decode sequence
                    steps = -(-kv_end[t] // block_kv)
                    assert 1 <= num_splits[t] <= max_splits and split_steps[t] >= 1
                    # splits [s * split_steps, ...) for s < num_splits: all non-empty, covering every step
                    assert (num_splits[t] - 1) * split_steps[t] < steps <= num_splits[t] * split_steps[t]
            else:
                assert kind_name == "prefill" and lo >= cu[n] and row_end[t] == num_tokens
    assert np.all(covered == 1)
    assert not (set(np.unique(meta_dec[tiles.KIND])) - {tiles.KIND_EMPTY, tiles.KIND_COMPUTE})


def test_under_jit_with_traced_metadata():
    cfg = CONFIGS[1]
    args = make_inputs(cfg, Batch([5, 1, 20], [3, 60, 0]), seed=1)
    fn = jax.jit(functools.partial(ragged_paged_attention, interpret=True, block_q=8))
    out = np.asarray(fn(*args), np.float64)
    ref = reference(*args, sm_scale=cfg.head_dim**-0.5)
    assert np.abs(out[:26] - ref[:26]).max() <= TOL["float32"] * np.abs(ref[:26]).max()
    assert np.all(out[26:] == 0)


def test_scalar_num_seqs_and_custom_scale():
    cfg = CONFIGS[0]
    args = list(make_inputs(cfg, Batch([3, 1], [4, 9]), seed=2))
    args[-1] = np.int32(2)
    out = np.asarray(ragged_paged_attention(*args, sm_scale=0.3, interpret=True), np.float64)
    ref = reference(*args, sm_scale=0.3)
    assert np.abs(out[:4] - ref[:4]).max() <= TOL["float32"] * np.abs(ref[:4]).max()


def test_interpreter_poisons_unwritten_outputs():
    """Sanity check for the poisoning argument above: outputs the kernel never writes come back NaN."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        @pl.when(x_ref[0] > 1.0)
        def _():
            o_ref[...] = x_ref[...]

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), interpret=True)(
        jnp.zeros((16,), jnp.float32)
    )
    assert np.isnan(np.asarray(out)).all()


# ---------------------------------------------------------------------------------------------------------
# Validation


def _valid_args(dtype=jnp.float32, hq=4, hkv=2, d=64, bs=16, nb=8, s=3, mb=4, t=16):
    return dict(
        q=jnp.zeros((t, hq, d), dtype),
        k_pages=jnp.zeros((nb, bs, hkv, d), dtype),
        v_pages=jnp.zeros((nb, bs, hkv, d), dtype),
        kv_lens=jnp.array([5, 1, 0], jnp.int32)[:s],
        block_tables=jnp.zeros((s, mb), jnp.int32),
        cu_q_lens=jnp.array([0, 5, 6, 6], jnp.int32)[: s + 1],
        num_seqs=jnp.array([2], jnp.int32),
    )


def _call(**overrides):
    args = _valid_args()
    kw = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return ragged_paged_attention(**args, interpret=True, **kw)


def test_valid_args_pass():
    out = _call()
    assert out.shape == (16, 4, 64)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(q=jnp.zeros((16, 4, 64), jnp.bfloat16)), "dtype"),
        (dict(k_pages=jnp.zeros((8, 16, 2, 64), jnp.bfloat16), v_pages=jnp.zeros((8, 16, 2, 64), jnp.bfloat16)), "dtype"),
        (dict(v_pages=jnp.zeros((8, 16, 2, 64), jnp.bfloat16)), "dtype"),
        (dict(q=jnp.zeros((16, 3, 64), jnp.float32)), "multiple of num_kv_heads"),
        (dict(q=jnp.zeros((16, 4, 32), jnp.float32)), "head_dim"),
        (dict(v_pages=jnp.zeros((8, 16, 2, 32), jnp.float32)), "shapes differ"),
        (dict(q=jnp.zeros((16, 256), jnp.float32)), "q must be"),
        (dict(q=jnp.zeros((16, 4, 64), jnp.int32), k_pages=jnp.zeros((8, 16, 2, 64), jnp.int32), v_pages=jnp.zeros((8, 16, 2, 64), jnp.int32)), "unsupported dtype"),
        (dict(block_tables=jnp.zeros((2, 4), jnp.int32)), "block_tables must be"),
        (dict(cu_q_lens=jnp.zeros((3,), jnp.int32)), "cu_q_lens must be"),
        (dict(num_seqs=jnp.zeros((2,), jnp.int32)), "num_seqs"),
        (dict(kv_lens=jnp.zeros((3,), jnp.float32)), "integer"),
        # Concrete values: a kv_len the block table cannot hold (4 blocks * 16 = 64 tokens).
        (dict(kv_lens=jnp.array([65, 1, 0], jnp.int32)), "max_blocks_per_seq"),
        (dict(kv_lens=jnp.array([4, 1, 0], jnp.int32)), "shorter than its query length"),
        (dict(num_seqs=jnp.array([4], jnp.int32)), "num_seqs"),
        (dict(cu_q_lens=jnp.array([0, 5, 17, 17], jnp.int32), kv_lens=jnp.array([5, 12, 0], jnp.int32)), "exceeds"),
        (dict(block_q=3), "power of two"),
        (dict(block_q=4), ">= 16"),  # 4 * next_pow2(2) = 8 rows: too small for tt.dot
        (dict(num_kv_pages_per_block=3), "power of two"),
        (dict(k_pages=jnp.zeros((8, 8, 2, 64)), v_pages=jnp.zeros((8, 8, 2, 64)), num_kv_pages_per_block=1), ">= 16"),
        (dict(num_kv_splits=3), "power of two"),
        (dict(config=KernelConfig(TileConfig(3, 1), TileConfig(8, 1))), "decode block_q=3"),
        (dict(config=KernelConfig(TileConfig(4, 1), TileConfig(8, 1))), "decode block_q \\* next_power_of_2"),
        (dict(config=KernelConfig(TileConfig(8, 1), TileConfig(8, 1), min_split_kv=0)), "positive"),
    ],
)
def test_validation_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        _call(**overrides)


def test_triton_only_constraints():
    args = _valid_args(d=80)
    ragged_paged_attention(**args, interpret=True)  # fine in interpret mode
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        ragged_paged_attention(**args, interpret=False)
    args = _valid_args(bs=24)
    with pytest.raises(ValueError, match="power-of-two block_size"):
        ragged_paged_attention(**args, interpret=False)


def test_traced_metadata_skips_value_checks_but_checks_shapes():
    args = _valid_args()
    bad = dict(args, kv_lens=jnp.array([65, 1, 0], jnp.int32))
    jax.jit(functools.partial(ragged_paged_attention, interpret=True)).trace(**bad)  # no value check
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        jax.jit(functools.partial(ragged_paged_attention, interpret=True)).trace(
            **dict(args, q=jnp.zeros((16, 3, 64), jnp.float32))
        )


# ---------------------------------------------------------------------------------------------------------
# Backend selection


def test_get_attention_fn():
    assert get_attention_fn("xla") is ragged_paged_attention_xla
    fn = get_attention_fn("pallas")
    assert fn.func is ragged_paged_attention
    assert fn.keywords["interpret"] is (jax.default_backend() == "cpu")
    assert get_attention_fn("pallas", interpret=True).keywords["interpret"] is True
    with pytest.raises(ValueError, match=r"\['xla', 'pallas'\]"):
        get_attention_fn("triton")
    if jax.default_backend() == "cpu":
        with pytest.raises(NotImplementedError):
            get_attention_fn("pallas", interpret=False)
    args = make_inputs(CONFIGS[0], Batch([2, 1], [0, 7]), seed=3)
    np.testing.assert_allclose(
        np.asarray(get_attention_fn("pallas")(*args))[:3], np.asarray(get_attention_fn("xla")(*args))[:3], rtol=1e-5, atol=1e-5
    )


# ---------------------------------------------------------------------------------------------------------
# GPU lowering on a CPU-only machine


@pytest.mark.parametrize(
    "dtype, hq, hkv, d, bs, max_blocks, kwargs",
    [
        # Mistral-7B heads, default (rule or table) config: prefill tiles, split decode tiles and the merge.
        ("bfloat16", 32, 8, 128, 16, 64, {}),
        # Long context: the split bound reaches 16.
        ("bfloat16", 32, 8, 128, 16, 1024, {}),
        ("float32", 8, 8, 64, 32, 32, dict(block_q=16)),
        # GQA group 7 (padded to 8), llama-1b-like head_dim 64.
        ("bfloat16", 28, 4, 128, 16, 32, {}),
        ("bfloat16", 32, 8, 64, 16, 256, {}),
        # Decode tiles written directly (no split), and decode tiles disabled.
        ("bfloat16", 32, 8, 128, 16, 64, dict(num_kv_splits=1)),
        ("float16", 32, 8, 128, 16, 64, dict(config=KernelConfig(TileConfig(0, 4), TileConfig(16, 4)))),
    ],
)
def test_lowers_for_gpu_through_triton(monkeypatch, dtype, hq, hkv, d, bs, max_blocks, kwargs):
    """Lowers the kernels for the "cuda" platform (no GPU needed): the Pallas Triton lowering runs every
    rule and builds the Triton (tt) MLIR modules (prefill tiles; decode tiles, split or direct; the merge),
    which must pass MLIR verification, and the StableHLO module carries them as `__gpu$xla.gpu.triton`
    custom calls. Triton-to-PTX compilation itself happens in XLA's GPU compiler, which needs a GPU build,
    so it is not exercised here."""
    from jax._src.pallas.triton import lowering as triton_lowering

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kw):
        result = original(*args, **kw)
        op = result.module.operation
        with op.context:
            modules.append((op.verify(), op.get_asm()))
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", capture)
    t, nb, s = 128, 256, 16
    dt = jnp.dtype(dtype)
    args = (
        jax.ShapeDtypeStruct((t, hq, d), dt),
        jax.ShapeDtypeStruct((nb, bs, hkv, d), dt),
        jax.ShapeDtypeStruct((nb, bs, hkv, d), dt),
        jax.ShapeDtypeStruct((s,), jnp.int32),
        jax.ShapeDtypeStruct((s, max_blocks), jnp.int32),
        jax.ShapeDtypeStruct((s + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    config, _ = resolve_kernel_config((t, hq, d), (nb, bs, hkv, d), (s, max_blocks), dt, **kwargs)
    fn = functools.partial(ragged_paged_attention, interpret=False, **kwargs)
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    expected = ["rpa_prefill"]
    if config.decode.block_q:
        expected += ["rpa_decode_split", "rpa_merge"] if config.max_splits > 1 else ["rpa_decode_bq"]
    assert text.count("__gpu$xla.gpu.triton") == len(expected)
    assert len(modules) == len(expected)
    g_pad = _next_pow2(hq // hkv)
    for name, (verified, asm) in zip(expected, modules):
        assert verified
        assert f"tt.func public @{name}" in asm
        if name == "rpa_merge":
            assert "tt.dot" not in asm and "scf.for" in asm  # a loop over the used splits
            continue
        # q k^T and p v, in the unmasked loop over fully visible KV steps and in the masked loop.
        assert asm.count("tt.dot") == 4
        assert asm.count("scf.for") == 2
        if dtype == "float32":
            # Full float32 (IEEE, the printer's default, so not spelled out) matmuls, not Triton's TF32 default.
            assert "tf32" not in asm
        tile = config.prefill if name == "rpa_prefill" else config.decode
        assert f"tensor<{tile.block_q * g_pad}x{d}x" in asm  # the GQA group is folded into one matrix
        if name == "rpa_decode_split":
            assert f"_split{config.max_splits}_" in asm
    if max_blocks == 1024 and not kwargs:
        assert config.max_splits == 16


# ---------------------------------------------------------------------------------------------------------
# Benchmark script smoke test


def test_bench_runs(capsys, tmp_path):
    import json

    from pallas_kernels import bench

    out_file = tmp_path / "bench.json"
    bench.main([
        "--decodes", "3", "--decode-ctx", "40", "--prefill-chunks", "17,5", "--prefill-ctx", "0,30",
        "--num-q-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "float32",
        "--iters", "1", "--matmul-n", "64", "--copy-mib", "1", "--shuffle-seqs", "--num-kv-splits", "2",
        "--out", str(out_file),
    ])
    out = capsys.readouterr().out
    assert "pallas vs xla" in out and "(OK" in out and "floor" in out
    assert "FlashAttention comparison:" in out and "config: rules decode; rules prefill + explicit num_kv_splits" in out
    result = json.loads(out_file.read_text())
    (case,) = result["cases"]
    assert case["ok"] and case["config"]["max_splits"] == 2 and case["floor_us"] > 0 and case["pallas_us"] > 0


def test_bench_suite_has_the_issue_rows():
    from pallas_kernels import bench

    rows = {(c.decodes, c.decode_ctx, c.chunks, c.chunk_ctx) for c in bench.SUITE}
    assert rows == {
        (64, 1024, (), ()), (256, 2048, (), ()), (8, 16384, (), ()), (32, 1024, (512,), (1536,)),
        (0, 0, (2048,), (0,)), (0, 0, (512,), (1536,)),
    }
