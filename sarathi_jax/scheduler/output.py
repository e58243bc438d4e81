"""What one `Scheduler.schedule()` call hands the engine: plain data, no JAX."""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_jax.sequence import Sequence


class ScheduledChunk:
    """`num_new_tokens` query tokens of `seq`, at positions start_position .. start_position+num_new_tokens-1.

    `needs_sample` and `is_decode` are fixed at schedule time (the sequence keeps changing afterwards).
    `decode`: whether the scheduler ran it as a decode; None derives it from the shape (one sampled token
    after others), which a prompt's last token after a cached prefix also has.

    Read-only by convention. A plain `__slots__` class, not a frozen dataclass: the scheduler makes one per
    sequence per step, and enforced immutability would cost more than the rest of building it.
    """

    __slots__ = ("seq", "num_new_tokens", "start_position", "needs_sample", "is_decode")

    def __init__(self, seq: Sequence, num_new_tokens: int, start_position: int, decode: bool | None = None) -> None:
        num_tokens = seq.num_tokens
        end = start_position + num_new_tokens
        if num_new_tokens < 1 or end > num_tokens:
            raise ValueError(f"bad chunk for {seq!r}: {num_new_tokens} tokens at {start_position}")
        self.seq = seq
        self.num_new_tokens = num_new_tokens
        self.start_position = start_position
        self.needs_sample = end == num_tokens
        if decode is None:
            decode = start_position > 0 and num_new_tokens == 1 and self.needs_sample
        self.is_decode = decode

    def __repr__(self) -> str:
        return (f"ScheduledChunk(seq={self.seq!r}, num_new_tokens={self.num_new_tokens}, start_position="
                f"{self.start_position}, needs_sample={self.needs_sample}, is_decode={self.is_decode})")


@dataclass(frozen=True)
class SchedulerOutput:
    """One batch.

    chunks: the work of this iteration, in a fixed order (the runner packs them in this order).
    preempted: sequences evicted (by recompute) while building this batch; they are back in the waiting queue.
    """

    chunks: tuple[ScheduledChunk, ...] = ()
    preempted: tuple[Sequence, ...] = ()
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @classmethod
    def of(cls, chunks: tuple[ScheduledChunk, ...], *, preempted: tuple[Sequence, ...] = ()) -> SchedulerOutput:
        """The output for `chunks`, with its prefill / decode token counts."""
        num_decode = sum([c.is_decode for c in chunks])
        num_prefill = sum([c.num_new_tokens for c in chunks]) - num_decode
        return cls(chunks, preempted, num_prefill, num_decode)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        """No work to run (there may still be preempted sequences to report)."""
        return not self.chunks
