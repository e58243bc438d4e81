"""One step's small inputs, packed into a single int32 array: one host-to-device transfer per step.

A step needs a dozen small arrays (token ids, positions, slot mapping, attention metadata, logits rows and
the sampler's settings). Passed one by one, each is its own transfer and its own argument to dispatch; packed,
the host fills one numpy buffer and uploads it once, and the jitted functions slice it apart with static
offsets (floats travel as their bit patterns).

Layout, for a bucket of T tokens, S = max_num_seqs rows, B = max_blocks_per_seq, M = MAX_BANNED:

    batch part (`BatchLayout`, 4T + S(3 + B) + 2 entries)
        token_ids      [T]     host token ids (0 where `src_rows` says the token is on the device)
        positions      [T]
        slot_mapping   [T]     -1 on padding rows
        src_rows       [T]     >= 0: the token is row `src_rows[t]` of the previous step's sampled tokens
        kv_lens        [S]
        cu_q_lens      [S + 1]
        num_seqs       [1]
        logits_indices [S]
        block_tables   [S * B]
    sampling part (`sampling_len(S)` = S(8 + M) entries, always last)
        temperature [S] f32, top_k [S], top_p [S] f32, min_p [S] f32, keys [S * 2] u32, steps [S],
        banned_token_ids [S * M], num_logprobs [S]
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sarathi_jax.models import AttentionMetadata
from sarathi_jax.sampling import MAX_BANNED, SamplingArrays


def sampling_len(max_num_seqs: int) -> int:
    return max_num_seqs * (8 + MAX_BANNED)


@dataclass(frozen=True)
class BatchLayout:
    """Offsets of the batch part for one bucket (all static)."""

    num_tokens: int  # T, the bucket
    max_num_seqs: int  # S
    max_blocks_per_seq: int  # B

    @property
    def batch_len(self) -> int:
        t, s, b = self.num_tokens, self.max_num_seqs, self.max_blocks_per_seq
        return 4 * t + s * (3 + b) + 2

    @property
    def total_len(self) -> int:
        return self.batch_len + sampling_len(self.max_num_seqs)

    @classmethod
    def of_packed(cls, packed_len: int, max_num_seqs: int, max_blocks_per_seq: int) -> BatchLayout:
        """The layout of a packed array of `packed_len` entries (T recovered from the length)."""
        s, b = max_num_seqs, max_blocks_per_seq
        four_t = packed_len - sampling_len(s) - s * (3 + b) - 2
        assert four_t > 0 and four_t % 4 == 0, (packed_len, s, b)
        return cls(four_t // 4, s, b)

    def _fields(self) -> list[tuple[str, int]]:
        t, s, b = self.num_tokens, self.max_num_seqs, self.max_blocks_per_seq
        return [("token_ids", t), ("positions", t), ("slot_mapping", t), ("src_rows", t), ("kv_lens", s),
                ("cu_q_lens", s + 1), ("num_seqs", 1), ("logits_indices", s), ("block_tables", s * b)]

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Writable numpy views of each batch field in `buf` (block_tables as [S, B])."""
        views, offset = {}, 0
        for name, size in self._fields():
            views[name] = buf[offset : offset + size]
            offset += size
        views["block_tables"] = views["block_tables"].reshape(self.max_num_seqs, self.max_blocks_per_seq)
        return views

    def empty(self) -> np.ndarray:
        """An all-padding packed buffer: no sequences, no-op sampling rows (temperature -1)."""
        buf = np.zeros(self.total_len, np.int32)
        views = self.host_views(buf)
        views["slot_mapping"][:] = -1
        views["src_rows"][:] = -1
        return buf

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


def pack_sampling(arrays: SamplingArrays, out: np.ndarray) -> None:
    """Write host `SamplingArrays` (from `make_sampling_arrays`) into the sampling part `out` (int32)."""
    offset = 0
    for field in arrays:
        flat = np.ascontiguousarray(field).reshape(-1).view(np.int32)
        out[offset : offset + flat.size] = flat
        offset += flat.size
    assert offset == out.size, (offset, out.size)


def unpack_sampling(packed: jax.Array, max_num_seqs: int) -> SamplingArrays:
    """Device side: the `SamplingArrays` in the last `sampling_len(S)` entries of a packed array."""
    s, m = max_num_seqs, MAX_BANNED
    part = packed[packed.shape[0] - sampling_len(s) :]
    as_f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
    return SamplingArrays(
        temperature=as_f32(part[0:s]),
        top_k=part[s : 2 * s],
        top_p=as_f32(part[2 * s : 3 * s]),
        min_p=as_f32(part[3 * s : 4 * s]),
        keys=jax.lax.bitcast_convert_type(part[4 * s : 6 * s], jnp.uint32).reshape(s, 2),
        steps=part[6 * s : 7 * s],
        banned_token_ids=part[7 * s : (7 + m) * s].reshape(s, m),
        num_logprobs=part[(7 + m) * s : (8 + m) * s],
    )
