"""The batches `python -m benchmarks.kernels` (and `pallas_kernels.tune`, `benchmarks.gpu_report`) runs: head
layouts, the GPU suite `SUITE` (six batches: decodes, a mixed step, prefills) and the CPU suite `CPU_SUITE`, the
seven attention arguments of a batch (`build_batch`) and its work (`count_work`: FLOPs and minimal bytes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

HEADS = {  # name: (num_q_heads, num_kv_heads, head_dim)
    "mistral7b": (32, 8, 128),
    "llama1b": (32, 8, 64),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """A batch: `decodes` decode rows at `decode_ctx` tokens of context, plus prefill chunks of
    `chunks[i]` tokens after `chunk_ctx[i]` tokens of context."""

    name: str
    decodes: int = 0
    decode_ctx: int = 0
    chunks: tuple[int, ...] = ()
    chunk_ctx: tuple[int, ...] = ()

    def seqs(self) -> list[tuple[int, int]]:
        """(q_len, kv_len) per sequence."""
        return [(1, self.decode_ctx + 1)] * self.decodes + [(c, c + x) for c, x in zip(self.chunks, self.chunk_ctx)]


SUITE = (
    Case("64 decodes x ctx 1024", decodes=64, decode_ctx=1024),
    Case("256 decodes x ctx 2048", decodes=256, decode_ctx=2048),
    Case("8 decodes x ctx 16384", decodes=8, decode_ctx=16384),
    Case("32 decodes ctx 1024 + 512 chunk at ctx 1536", decodes=32, decode_ctx=1024, chunks=(512,), chunk_ctx=(1536,)),
    Case("prefill 2048 tokens", chunks=(2048,), chunk_ctx=(0,)),
    Case("512-token chunk at ctx 1536", chunks=(512,), chunk_ctx=(1536,)),
)


# The CPU suite: head layouts (q heads, KV heads, head_dim) with GQA groups 1, 4 and 8, and batches.
CPU_HEADS = ((8, 8, 64), (32, 8, 64), (8, 1, 64), (32, 8, 128), (16, 2, 128))
CPU_SUITE = tuple(
    Case(f"{b} decode{'s' if b > 1 else ''} x ctx {ctx}", decodes=b, decode_ctx=ctx)
    for b in (1, 32, 128) for ctx in (64, 512, 4096)
) + (
    Case("32 decodes ctx 1024 + 512 chunk at ctx 1536", decodes=32, decode_ctx=1024, chunks=(512,), chunk_ctx=(1536,)),
    Case("16-token chunk at ctx 512 (short prefill)", chunks=(16,), chunk_ctx=(512,)),
    Case("prefill 512 tokens", chunks=(512,), chunk_ctx=(0,)),
    Case("512-token chunk at ctx 1536", chunks=(512,), chunk_ctx=(1536,)),
    Case("prefill 2048 tokens", chunks=(2048,), chunk_ctx=(0,)),
)


def build_batch(seqs, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, rng: np.random.Generator,
                pad_seqs: int = 2, pad_rows: int = 0, seed: int = 0):
    """The 7 attention arguments for `seqs` ((q_len, kv_len) per sequence, in order); shuffled pages."""
    bs = block_size
    n = len(seqs)
    max_num_seqs = n + pad_seqs
    num_rows = sum(q for q, _ in seqs)
    num_tokens = -(-num_rows // 16) * 16 + pad_rows
    max_blocks = -(-max(kv for _, kv in seqs) // bs)
    num_blocks = sum(-(-kv // bs) for _, kv in seqs) + 1
    kv_lens = np.zeros(max_num_seqs, np.int32)
    cu = np.zeros(max_num_seqs + 1, np.int32)
    block_tables = np.zeros((max_num_seqs, max_blocks), np.int32)
    free = list(rng.permutation(num_blocks))
    for i, (ql, kv) in enumerate(seqs):
        kv_lens[i] = kv
        cu[i + 1] = cu[i] + ql
        for b in range(-(-kv // bs)):
            block_tables[i, b] = free.pop()
    cu[n + 1 :] = cu[n]
    kq, kk, kv_ = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (num_tokens, num_q_heads, head_dim), jnp.float32).astype(dtype)
    cache_shape = (num_blocks, bs, num_kv_heads, head_dim)
    k_pages = jax.random.normal(kk, cache_shape, jnp.float32).astype(dtype)
    v_pages = jax.random.normal(kv_, cache_shape, jnp.float32).astype(dtype)
    return (q, k_pages, v_pages, jnp.asarray(kv_lens), jnp.asarray(block_tables), jnp.asarray(cu),
            jnp.asarray([n], jnp.int32))


def count_work(seqs, *, num_q_heads, num_kv_heads, head_dim, itemsize):
    flops = 0
    kv_bytes = 0
    for ql, kv in seqs:
        visible = ql * (kv - ql) + ql * (ql + 1) // 2  # keys seen by the query rows, causal
        flops += 4 * head_dim * visible * num_q_heads
        kv_bytes += 2 * kv * num_kv_heads * head_dim * itemsize
    rows = sum(ql for ql, _ in seqs)
    q_out_bytes = 2 * rows * num_q_heads * head_dim * itemsize
    return flops, kv_bytes + q_out_bytes
