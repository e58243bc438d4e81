"""Ragged paged attention: the Pallas kernel (interpret mode on CPU) and the jnp path against the float64
numpy reference beside them (`pallas_kernels/reference.py`), which shares no code with either.

Error measure: rel_err = max|out - ref| / max|ref| over all valid rows (a max-norm relative error);
bounds 1e-5 for float32 and 2e-2 for bfloat16 inputs. Argument validation, backend selection, lowering to
Triton and the benchmark script are in test_ragged_paged_attention_api.py; the shared inputs in
kernel_cases.py.

Poisoning: the Pallas interpreter initialises kernel outputs with NaN (checked by
`test_interpreter_poisons_unwritten_outputs`), so "no NaN in the output" means the kernel wrote every row.
Inputs are poisoned as well: padding query rows, cache pages no sequence owns, cache slots past a
sequence's kv_len, and block-table entries past a sequence's last block (which point at random pages,
often NaN ones). Padding rows must come out exactly zero.

Shapes are fixed per configuration (one compile each); hypothesis varies the ragged metadata and data.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import ragged_paged_attention, ragged_paged_attention_xla
from pallas_kernels import ragged_paged_attention_tiles as tiles
from pallas_kernels.reference import ragged_paged_attention_reference as reference
from tests.pallas_kernels.kernel_cases import (
    CONFIGS, EDGE_CASES, HYPO, TOL, Batch, Cfg, assert_matches_reference, batches, make_inputs,
)


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
    ref = reference(*args, sm_scale=cfg.head_dim**-0.5)
    for path in paths:
        out = run_kernel(cfg, args) if path == "pallas" else _xla_jitted()(*args)
        assert_matches_reference(out, args, cfg, f"{path} {cfg} {batch}", ref)


@pytest.mark.parametrize("mode", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_random_batches(cfg, mode):
    @HYPO
    @given(batch=batches(cfg, mode), seed=st.integers(0, 2**31 - 1))
    def inner(batch, seed):
        check(cfg, batch, seed)

    inner()


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
