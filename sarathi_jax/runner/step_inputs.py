"""One step's small inputs, packed into two int32 arrays, which the jitted calls take as they are.

A step needs a dozen small arrays (token ids, positions, slot mapping, attention metadata, logits rows and
the sampler's settings). Passed one by one, each is its own transfer and its own argument to dispatch; packed,
the host fills two numpy buffers (`PackedStep`, kept and updated in place by `sarathi_jax.runner.input_batch`) and
hands them to the jitted calls (`Stage.upload`), and the jitted functions slice them apart with static offsets (floats travel as their
bit patterns). The batch part's size depends on the bucket; the sampling part's does not.

A bucket of T tokens holds at most min(T, S) sequences (each has at least one token), so its step final-norms
its first `BatchLayout.num_rows` = min(T, S) rows only (padded to [S, embed]). The LM head and the sampler then
run on R rows, R the smallest of the buckets' row counts (`row_ladder`) that holds the step's sequences
(`sample_rows`): a 512-token prefill of one sequence pays for 4 rows of the LM head, not 128, and a small
bucket for neither max_num_seqs rows of the LM head nor the sampler's [S, vocab] work. The sampler slices its
rows out of the sampling part (`unpack_sampling(part, S, rows)`), so it compiles once per variant and R.

Batch part (`BatchLayout`, S(3 + B) + 2 + 4T entries), for a bucket of T tokens, S = max_num_seqs rows,
B = max_blocks_per_seq. The per-row fields come first, so their offsets do not depend on the bucket:
    kv_lens        [S]
    cu_q_lens      [S + 1]
    num_seqs       [1]
    logits_indices [S]
    block_tables   [S * B]
    token_ids      [T]     host token ids (0 where `src_rows` says the token is on the device)
    positions      [T]
    slot_mapping   [T]     -1 on padding rows
    src_rows       [T]     >= 0: the token is row `src_rows[t]` of the previous step's sampled tokens
Sampling part (`sampling_len(S)` = S(8 + M) entries, M = MAX_BANNED):
    temperature [S] f32, top_k [S], top_p [S] f32, min_p [S] f32, keys [S * 2] u32, steps [S],
    banned_token_ids [S * M], num_logprobs [S]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sarathi_jax.models import AttentionMetadata
from sarathi_jax.runner.sample.inputs import MAX_BANNED, SamplingArrays, empty_sampling_arrays
from sarathi_jax.config.sizing import bucket_for


# The sampling part's fields, in `SamplingArrays` order: (entries per row, dtype as stored bit for bit).
_SAMPLING_FIELDS = ((1, np.float32), (1, np.int32), (1, np.float32), (1, np.float32), (2, np.uint32),
                    (1, np.int32), (MAX_BANNED, np.int32), (1, np.int32))


_SAMPLING_WIDTH = sum(width for width, _ in _SAMPLING_FIELDS)  # entries per row


def sampling_len(max_num_seqs: int) -> int:
    return max_num_seqs * _SAMPLING_WIDTH


def sampling_max_num_seqs(sampling_len: int) -> int:
    """S of a sampling part of `sampling_len` entries."""
    assert sampling_len % _SAMPLING_WIDTH == 0, sampling_len
    return sampling_len // _SAMPLING_WIDTH


class PackedStep(NamedTuple):
    """The two int32 arrays of one step (host numpy before the upload, device arrays after)."""

    batch: np.ndarray
    sampling: np.ndarray


@dataclass(frozen=True)
class BatchLayout:
    """Offsets of the batch part for one bucket (all static)."""

    num_tokens: int  # T, the bucket
    max_num_seqs: int  # S
    max_blocks_per_seq: int  # B

    @property
    def num_rows(self) -> int:
        """The rows that may sample: at most one per sequence, and a sequence has at least one token."""
        return min(self.num_tokens, self.max_num_seqs)

    @property
    def batch_len(self) -> int:
        t, s, b = self.num_tokens, self.max_num_seqs, self.max_blocks_per_seq
        return s * (3 + b) + 2 + 4 * t

    @property
    def num_seqs_index(self) -> int:
        """Where the batch part keeps `num_seqs`: after kv_lens [S] and cu_q_lens [S + 1], whatever the bucket."""
        return 2 * self.max_num_seqs + 1

    def num_seqs(self, batch: np.ndarray) -> int:
        """Host side: the sequences of a (host) batch part."""
        return int(batch[self.num_seqs_index])

    @classmethod
    def of_packed(cls, batch_len: int, max_num_seqs: int, max_blocks_per_seq: int) -> BatchLayout:
        """The layout of a batch part of `batch_len` entries (T recovered from the length)."""
        s, b = max_num_seqs, max_blocks_per_seq
        four_t = batch_len - s * (3 + b) - 2
        assert four_t > 0 and four_t % 4 == 0, (batch_len, s, b)
        return cls(four_t // 4, s, b)

    def _fields(self) -> list[tuple[str, int]]:
        t, s, b = self.num_tokens, self.max_num_seqs, self.max_blocks_per_seq
        return [("kv_lens", s), ("cu_q_lens", s + 1), ("num_seqs", 1), ("logits_indices", s), ("block_tables", s * b),
                ("token_ids", t), ("positions", t), ("slot_mapping", t), ("src_rows", t)]

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Writable numpy views of each batch field in `buf` (block_tables as [S, B])."""
        views, offset = {}, 0
        for name, size in self._fields():
            views[name] = buf[offset : offset + size]
            offset += size
        views["block_tables"] = views["block_tables"].reshape(self.max_num_seqs, self.max_blocks_per_seq)
        return views

    def empty_batch(self) -> np.ndarray:
        """An all-padding batch part: no sequences."""
        buf = np.zeros(self.batch_len, np.int32)
        views = self.host_views(buf)
        views["slot_mapping"][:] = -1
        views["src_rows"][:] = -1
        return buf

    def empty(self) -> PackedStep:
        """An all-padding step: no sequences, and sampling rows that are no-ops (temperature -1)."""
        return PackedStep(self.empty_batch(), pack_sampling(empty_sampling_arrays(self.max_num_seqs)))

    def unpack_batch(self, packed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, AttentionMetadata, jax.Array]:
        """Device side: (token_ids, src_rows, positions, metadata, logits_indices)."""
        parts, offset = {}, 0
        for name, size in self._fields():
            parts[name] = packed[offset : offset + size]
            offset += size
        metadata = AttentionMetadata(
            slot_mapping=parts["slot_mapping"],
            kv_lens=parts["kv_lens"],
            block_tables=parts["block_tables"].reshape(self.max_num_seqs, self.max_blocks_per_seq),
            cu_q_lens=parts["cu_q_lens"],
            num_seqs=parts["num_seqs"],
        )
        return parts["token_ids"], parts["src_rows"], parts["positions"], metadata, parts["logits_indices"]


def row_ladder(buckets: Sequence[int], max_num_seqs: int) -> tuple[int, ...]:
    """The row counts the LM head and the sampler run at, ascending: each bucket's `BatchLayout.num_rows`."""
    return tuple(sorted({min(bucket, max_num_seqs) for bucket in buckets}))


def sample_rows(ladder: Sequence[int], num_seqs: int) -> int:
    """The rows a step of `num_seqs` sequences samples: the smallest of `ladder` that holds them (at most its
    bucket's `num_rows`, which is on the ladder and holds them)."""
    rows = bucket_for(ladder, num_seqs)
    assert rows is not None, (ladder, num_seqs)
    return rows


def pack_sampling(arrays: SamplingArrays) -> np.ndarray:
    """The sampling part (int32) of host `SamplingArrays`."""
    part = np.concatenate([np.ascontiguousarray(field).reshape(-1).view(np.int32) for field in arrays])
    assert part.size == sampling_len(arrays.temperature.shape[0]), part.size
    return part


def _split_sampling(part, max_num_seqs: int, as_dtype, rows: int | None = None) -> SamplingArrays:
    """`part` cut into the `SamplingArrays` fields, each cut to its first `rows` rows (default all)
    (`as_dtype(x, dtype)` reinterprets an int32 slice)."""
    s, fields, offset = max_num_seqs, [], 0
    r = s if rows is None else rows
    assert part.shape == (sampling_len(s),) and 0 < r <= s, (part.shape, s, r)
    for width, dtype in _SAMPLING_FIELDS:
        x = part[offset * s : offset * s + width * r]
        x = x if dtype == np.int32 else as_dtype(x, dtype)
        fields.append(x.reshape(r, width) if width > 1 else x)
        offset += width
    return SamplingArrays(*fields)


def sampling_views(part: np.ndarray, max_num_seqs: int) -> SamplingArrays:
    """Host side: writable numpy views of each field of a sampling part (floats and keys as their dtypes)."""
    assert part.dtype == np.int32, part.dtype
    return _split_sampling(part, max_num_seqs, lambda x, dtype: x.view(dtype))


def unpack_sampling(part: jax.Array, max_num_seqs: int, rows: int | None = None) -> SamplingArrays:
    """Device side: the `SamplingArrays` of a sampling part, its first `rows` rows (default all)."""
    return _split_sampling(part, max_num_seqs, lambda x, dtype: jax.lax.bitcast_convert_type(x, jnp.dtype(dtype)),
                           rows)
