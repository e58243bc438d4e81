"""The jnp ragged paged attention (`ragged_paged_attention_xla`) on the batch shapes its work split is built
for, against the float64 numpy reference beside the kernels
(`pallas_kernels/reference.py`).

The xla path splits the work (see its module docstring): decode rows and rows of short prefills go through a
per-row path (rows sorted by how far they look back, processed in groups, each group looping to its own
longest extent in large KV steps, then small ones); longer prefill sequences go through query tiles that share their KV reads and loop only up
to the causal limit of the tile. These tests cover batches that stress that split: many short prompts in
one batch (what the vLLM policy builds), decodes with much longer context than the prefills next to them,
prefills next to much longer decodes, 1-token prompts, num_seqs = 0, GQA groups (including 3), bfloat16,
and, through the private entry point with tiny static sizes, many tiles per sequence, many KV steps per tile,
several per-row groups and steps that are not a whole divisor of the block table.

Inputs are poisoned as in `test_ragged_paged_attention.py`: NaN padding query rows, NaN cache pages no
sequence owns, NaN slots past each kv_len, and block-table entries past a sequence's last block that point
at random pages (some out of range). Outputs must be NaN-free, exactly zero on padding rows, and within
rel_err = max|out - ref| / max|ref| <= 1e-5 (float32) or 2e-2 (bfloat16) of the reference.
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

from pallas_kernels import ragged_paged_attention_xla
from pallas_kernels.ragged_paged_attention_xla import _ragged_paged_attention_xla
from pallas_kernels.reference import ragged_paged_attention_reference as reference

TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Shape:
    dtype: str = "float32"
    num_tokens: int = 128  # T, the bucket
    max_num_seqs: int = 40
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    max_blocks: int = 16  # capacity = max_blocks * block_size

    @property
    def capacity(self):
        return self.max_blocks * self.block_size

    @property
    def num_blocks(self):
        # Every sequence can be full, and a few pages nobody owns stay NaN.
        return self.max_num_seqs * self.max_blocks + 5


def make_inputs(shape: Shape, q_lens, ctx_lens, seed):
    rng = np.random.default_rng(seed)
    n = len(q_lens)
    s_max, bs = shape.max_num_seqs, shape.block_size
    kv_lens = np.zeros(s_max, np.int32)
    cu = np.zeros(s_max + 1, np.int32)
    for i, (ql, ctx) in enumerate(zip(q_lens, ctx_lens)):
        kv_lens[i] = ql + ctx
        cu[i + 1] = cu[i] + ql
    cu[n + 1 :] = cu[n]
    assert cu[n] <= shape.num_tokens and kv_lens.max(initial=0) <= shape.capacity
    pages_needed = sum(-(-int(kv) // bs) for kv in kv_lens[:n])
    assert pages_needed < shape.num_blocks, "batch needs more pages than the cache has"

    cache = (shape.num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    k_pages = np.full(cache, np.nan, np.float32)
    v_pages = np.full(cache, np.nan, np.float32)
    # Garbage entries: random pages (often NaN ones), and some ids outside the cache.
    block_tables = rng.integers(-3, shape.num_blocks + 3, (s_max, shape.max_blocks)).astype(np.int32)
    free = list(rng.permutation(shape.num_blocks))
    for i in range(n):
        kv = int(kv_lens[i])
        for b in range(-(-kv // bs)):
            page = free.pop()
            block_tables[i, b] = page
            used = min(bs, kv - b * bs)
            k_pages[page, :used] = rng.standard_normal((used, shape.num_kv_heads, shape.head_dim))
            v_pages[page, :used] = rng.standard_normal((used, shape.num_kv_heads, shape.head_dim))
    q = rng.standard_normal((shape.num_tokens, shape.num_q_heads, shape.head_dim)).astype(np.float32)
    q[cu[n] :] = np.nan
    dtype = jnp.dtype(shape.dtype)
    q, k_pages, v_pages = (np.asarray(jnp.asarray(x, dtype)) for x in (q, k_pages, v_pages))
    return q, k_pages, v_pages, kv_lens, block_tables, cu, np.array([n], np.int32)


@functools.cache
def _jitted(**static):
    if not static:
        return jax.jit(ragged_paged_attention_xla)
    return jax.jit(functools.partial(_ragged_paged_attention_xla, sm_scale=None, **static))


def check(shape: Shape, q_lens, ctx_lens, seed, **static):
    args = make_inputs(shape, q_lens, ctx_lens, seed)
    out = _jitted(**static)(*args)
    q, *_, cu, num_seqs = args
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out, np.float64)
    end = int(cu[int(num_seqs[0])])
    assert not np.isnan(out).any(), "NaN in the output (poison leaked)"
    assert np.all(out[end:] == 0.0), "padding rows are not exactly zero"
    if end:
        ref = reference(*args, sm_scale=shape.head_dim**-0.5)
        err = np.abs(out[:end] - ref[:end]).max() / max(np.abs(ref[:end]).max(), 1e-30)
        assert err <= TOL[shape.dtype], f"rel_err={err:.3g} for q_lens={q_lens} ctx_lens={ctx_lens} {static}"


# ---------------------------------------------------------------------------------------------------------
# Batch strategies


@st.composite
def many_prompts(draw, shape: Shape):
    """Many fresh prompts of a few tokens each (vLLM-style prefill batches), sometimes 1-token ones, and
    sometimes a few decodes or one longer prompt in between."""
    n = draw(st.integers(10, shape.max_num_seqs))
    q_lens, ctx_lens, budget = [], [], shape.num_tokens
    for _ in range(n):
        kind = draw(st.sampled_from(["prompt", "prompt", "prompt", "decode", "long"]))
        if kind == "decode":
            ql, ctx = 1, draw(st.integers(0, shape.capacity - 1))
        elif kind == "long":
            ql, ctx = draw(st.integers(2, max(2, budget))), 0
        else:
            ql, ctx = draw(st.integers(1, 8)), 0
        if ql > budget:
            break
        q_lens.append(ql)
        ctx_lens.append(ctx)
        budget -= ql
    return q_lens, ctx_lens


@st.composite
def long_decodes_short_prefills(draw, shape: Shape):
    """Decodes with (much) longer context than the prefills and chunks next to them, in random order."""
    n_dec = draw(st.integers(1, shape.max_num_seqs // 2))
    seqs = [(1, draw(st.integers(shape.capacity // 2, shape.capacity - 1))) for _ in range(n_dec)]
    budget = shape.num_tokens - n_dec
    for _ in range(draw(st.integers(1, 6))):
        if budget < 2:
            break
        ql = draw(st.integers(2, min(budget, 40)))
        ctx = draw(st.sampled_from([0, 0, draw(st.integers(1, 24))]))
        seqs.append((ql, ctx))
        budget -= ql
    order = draw(st.permutations(range(len(seqs))))
    return [seqs[i][0] for i in order], [seqs[i][1] for i in order]


@st.composite
def short_decodes_long_prefills(draw, shape: Shape):
    """Short decodes next to long chunks with a lot of prior context (tiles loop much further than rows)."""
    seqs = [(1, draw(st.integers(0, 20))) for _ in range(draw(st.integers(0, 10)))]
    budget = shape.num_tokens - len(seqs)
    for _ in range(draw(st.integers(1, 3))):
        if budget < 2:
            break
        ql = draw(st.integers(2, budget))
        seqs.append((ql, draw(st.integers(0, shape.capacity - ql))))
        budget -= ql
    order = draw(st.permutations(range(len(seqs))))
    return [seqs[i][0] for i in order], [seqs[i][1] for i in order]


@st.composite
def anything(draw, shape: Shape):
    n = draw(st.integers(0, shape.max_num_seqs))
    q_lens, ctx_lens, budget = [], [], shape.num_tokens
    for _ in range(n):
        if budget == 0:
            break
        ql = draw(st.sampled_from([1, 1, draw(st.integers(1, budget))]))
        ql = min(ql, budget)
        q_lens.append(ql)
        ctx_lens.append(draw(st.integers(0, shape.capacity - ql)))
        budget -= ql
    return q_lens, ctx_lens


STRATEGIES = {
    "many_prompts": many_prompts,
    "long_decodes_short_prefills": long_decodes_short_prefills,
    "short_decodes_long_prefills": short_decodes_long_prefills,
    "anything": anything,
}

HYPO = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

# The public function's default split sizes, on engine-like shapes (GQA 4:2, 1:1, 3:1; bfloat16).
PUBLIC_SHAPES = [
    Shape(),
    Shape(num_q_heads=3, num_kv_heads=1, block_size=8, max_blocks=32),
    Shape(dtype="bfloat16", num_q_heads=2, num_kv_heads=2, head_dim=64),
]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize(
    "shape", PUBLIC_SHAPES, ids=lambda s: f"{s.dtype}-hq{s.num_q_heads}-hkv{s.num_kv_heads}-bs{s.block_size}"
)
def test_public_default_split(shape, strategy):
    @HYPO
    @given(batch=STRATEGIES[strategy](shape), seed=st.integers(0, 2**31 - 1))
    def inner(batch, seed):
        check(shape, *batch, seed)

    inner()


# Tiny static split sizes: many tiles per sequence, many KV steps, several per-row groups, steps of 3 pages
# (not a divisor of max_blocks), short_kv = 0 (every prefill tiled) and short_kv large (every prefill per row).
SMALL_SHAPE = Shape(num_tokens=48, max_num_seqs=12, head_dim=16, block_size=4, max_blocks=24)
SPLITS = [
    dict(block_q=4, kv_pages_per_step=1, row_group=3, row_kv_pages_per_step=(1, 2, 4), short_kv=0),
    dict(block_q=1, kv_pages_per_step=3, row_group=1, row_kv_pages_per_step=2, short_kv=6),
    dict(block_q=5, kv_pages_per_step=2, row_group=5, row_kv_pages_per_step=(6, 3), short_kv=12),
    dict(block_q=64, kv_pages_per_step=32, row_group=64, row_kv_pages_per_step=32, short_kv=1000),
]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("split", SPLITS, ids=lambda d: "-".join(f"{k[:4]}{v}" for k, v in d.items()))
def test_small_split_sizes(split, strategy):
    @HYPO
    @given(batch=STRATEGIES[strategy](SMALL_SHAPE), seed=st.integers(0, 2**31 - 1))
    def inner(batch, seed):
        check(SMALL_SHAPE, *batch, seed, **split)

    inner()


EDGE_CASES = {
    "num_seqs_0": ([], []),
    "thirty_short_prompts": ([4] * 30, [0] * 30),
    "thirty_1_token_prompts": ([1] * 30, [0] * 30),
    "one_prompt_fills_bucket": ([128], [0]),
    "chunk_to_capacity": ([128], [128]),
    "decodes_at_capacity_and_prompts": ([1, 3, 1, 2, 1], [255, 0, 255, 0, 17]),
    "prefill_kv_at_short_threshold": ([2, 32, 33, 31], [30, 0, 0, 2]),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases(case):
    check(Shape(), *EDGE_CASES[case], seed=len(case))


def test_scalar_num_seqs_custom_scale_and_eager():
    shape = Shape()
    args = list(make_inputs(shape, [5, 1, 40], [3, 200, 0], seed=4))
    args[-1] = np.int32(3)
    out = np.asarray(ragged_paged_attention_xla(*args, sm_scale=0.25), np.float64)  # eager, not jitted
    ref = reference(*args, sm_scale=0.25)
    assert np.abs(out[:46] - ref[:46]).max() <= 1e-5 * np.abs(ref[:46]).max()
    assert np.all(out[46:] == 0.0)


def test_bucket_smaller_than_default_tile():
    shape = Shape(num_tokens=16, max_num_seqs=4)
    for q_lens, ctx in (([16], [100]), ([3, 1, 12], [0, 250, 40]), ([1] * 4, [0, 5, 60, 255])):
        check(shape, q_lens, ctx, seed=sum(q_lens))
