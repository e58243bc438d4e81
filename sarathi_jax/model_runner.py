"""Turns a scheduled batch into padded device arrays and runs one jitted step per iteration.

Every step runs at one of a few fixed token counts (`buckets`): tile-aligned sizes up to the largest batch
the scheduler can produce. All of them are compiled by `warmup()`, so serving never compiles again;
`num_compilations` counts traces of the step function and lets tests check that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sarathi_jax.models import AttentionMetadata, ModelConfig, get_model, init_kv_caches
from sarathi_jax.sampling import SamplerOutput, SamplingArrays, make_sampling_arrays, sample
from sarathi_jax.scheduler import ScheduledChunk

SMALLEST_BUCKET = 16


def token_buckets(max_step_tokens: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Powers of two from `smallest`, then `max_step_tokens` rounded up to a multiple of `smallest`."""
    top = -(-max_step_tokens // smallest) * smallest
    buckets = []
    size = smallest
    while size < top:
        buckets.append(size)
        size *= 2
    buckets.append(top)
    return tuple(buckets)


class ModelRunner:
    """Owns the parameters, the paged KV cache and the compiled step function of one model."""

    def __init__(
        self,
        model_config: ModelConfig,
        params: dict,
        *,
        dtype: jnp.dtype,
        attention_fn: Callable,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_step_tokens: int,
    ) -> None:
        self.model_config = model_config
        self.params = params
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buckets = token_buckets(max_step_tokens)
        self.model = get_model(model_config, dtype, attention_fn=attention_fn)
        self.kv_caches = init_kv_caches(model_config, num_blocks, block_size, dtype)
        self.num_compilations = 0
        # The KV cache is donated: XLA updates it in place instead of copying it every step.
        self._step = jax.jit(self._step_impl, donate_argnums=(1,))

    def _step_impl(
        self,
        params: dict,
        kv_caches: list,
        token_ids: jax.Array,
        positions: jax.Array,
        metadata: AttentionMetadata,
        logits_indices: jax.Array,
        sampling_arrays: SamplingArrays,
    ) -> tuple[SamplerOutput, list]:
        self.num_compilations += 1  # Python side effect: runs once per trace, never per call
        logits, kv_caches = self.model.apply(
            {"params": params}, token_ids, positions, kv_caches, metadata, logits_indices
        )
        return sample(logits, sampling_arrays), kv_caches

    def bucket_for(self, num_tokens: int) -> int:
        for bucket in self.buckets:
            if num_tokens <= bucket:
                return bucket
        raise ValueError(f"a batch of {num_tokens} tokens exceeds the largest bucket {self.buckets[-1]}")

    def warmup(self) -> None:
        """Compile every bucket with an all-padding batch (num_seqs = 0 writes nothing to the cache)."""
        for bucket in self.buckets:
            self._run(*self._empty_batch(bucket))

    def execute(self, chunks: Sequence[ScheduledChunk], sampling_rows: Sequence[tuple]) -> SamplerOutput:
        """Run one step; row i of the result is chunk i's sample (meaningful where chunk.needs_sample)."""
        num_tokens = sum(chunk.num_new_tokens for chunk in chunks)
        bucket = self.bucket_for(num_tokens)
        token_ids, positions, slot_mapping, kv_lens, block_tables, cu_q_lens = self._empty_host_arrays(bucket)
        logits_indices = np.zeros(self.max_num_seqs, np.int32)
        offset = 0
        block_size = self.block_size
        for i, chunk in enumerate(chunks):
            seq, start, n = chunk.seq, chunk.start_position, chunk.num_new_tokens
            end = offset + n
            token_ids[offset:end] = seq.token_ids[start : start + n]
            pos = np.arange(start, start + n, dtype=np.int32)
            positions[offset:end] = pos
            table = np.asarray(seq.block_table, np.int32)
            slot_mapping[offset:end] = table[pos // block_size] * block_size + pos % block_size
            kv_lens[i] = start + n
            block_tables[i, : len(table)] = table
            cu_q_lens[i + 1] = end
            logits_indices[i] = end - 1
            offset = end
        cu_q_lens[len(chunks) + 1 :] = offset
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            kv_lens=kv_lens,
            block_tables=block_tables,
            cu_q_lens=cu_q_lens,
            num_seqs=np.array([len(chunks)], np.int32),
        )
        sampling_arrays = make_sampling_arrays(sampling_rows, self.max_num_seqs)
        out = self._run(token_ids, positions, metadata, logits_indices, sampling_arrays)
        return jax.tree.map(np.asarray, out)

    def _run(self, token_ids, positions, metadata, logits_indices, sampling_arrays) -> SamplerOutput:
        out, self.kv_caches = self._step(
            self.params, self.kv_caches, token_ids, positions, metadata, logits_indices, sampling_arrays
        )
        return out

    def _empty_host_arrays(self, bucket: int) -> tuple[np.ndarray, ...]:
        return (
            np.zeros(bucket, np.int32),  # token_ids
            np.zeros(bucket, np.int32),  # positions
            np.full(bucket, -1, np.int32),  # slot_mapping: -1 rows are dropped, never written
            np.zeros(self.max_num_seqs, np.int32),  # kv_lens
            np.zeros((self.max_num_seqs, self.max_blocks_per_seq), np.int32),  # block_tables
            np.zeros(self.max_num_seqs + 1, np.int32),  # cu_q_lens
        )

    def _empty_batch(self, bucket: int) -> tuple:
        token_ids, positions, slot_mapping, kv_lens, block_tables, cu_q_lens = self._empty_host_arrays(bucket)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            kv_lens=kv_lens,
            block_tables=block_tables,
            cu_q_lens=cu_q_lens,
            num_seqs=np.zeros(1, np.int32),
        )
        logits_indices = np.zeros(self.max_num_seqs, np.int32)
        return token_ids, positions, metadata, logits_indices, make_sampling_arrays([], self.max_num_seqs)
