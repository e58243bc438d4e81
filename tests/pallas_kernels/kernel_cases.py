"""Shared inputs of the ragged paged attention tests: the kernel configurations (`CONFIGS`), ragged batches
(`Batch`) and `make_inputs`, which poisons everything the kernels must not read with NaN (padding query rows,
cache pages no sequence owns, cache slots past a sequence's kv_len, block-table entries past its last block)
and rounds to the input dtype so that the float64 reference sees exactly what the kernels see."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_paged_attention import KernelConfig, TileConfig
from pallas_kernels.reference import ragged_paged_attention_reference

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


def assert_matches_reference(out, args, cfg: Cfg, label: str, ref: np.ndarray | None = None) -> None:
    """`out` of a kernel on `args` (from make_inputs) against the float64 reference: q's shape and dtype, no
    NaN (every row written, no poison leaked), padding rows exactly zero, and the valid rows within TOL.
    `ref` may be passed when several outputs share one reference."""
    q, *_, cu_q_lens, num_seqs = args
    end = int(cu_q_lens[int(num_seqs[0])])
    assert out.shape == q.shape and out.dtype == q.dtype, label
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), f"{label}: NaN in output (a row was not written, or poison leaked)"
    assert np.all(out[end:] == 0.0), f"{label}: padding rows are not exactly zero"
    if end:
        if ref is None:
            ref = ragged_paged_attention_reference(*args, sm_scale=cfg.head_dim**-0.5)
        err = np.abs(out[:end] - ref[:end]).max() / max(np.abs(ref[:end]).max(), 1e-30)
        assert err <= TOL[cfg.dtype], f"{label}: rel_err={err:.3g}"
