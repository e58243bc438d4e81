"""Paged KV-cache block allocation, host side (no JAX).

Blocks are ids 0..num_blocks-1 into the device KV pages. A sequence's `block_table` lists its blocks in
position order: token at position p lives in block `block_table[p // block_size]`, slot `p % block_size`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from sarathi_jax.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Free list of KV blocks.

    `watermark_blocks` stay free when admitting new work (`can_allocate(..., use_watermark=True)`), so that
    running sequences can still grow a little before anything has to be preempted; growth of running
    sequences (`use_watermark=False`) may dip into them.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, watermark_blocks: int = 0) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(watermark_blocks, int) or not 0 <= watermark_blocks < num_blocks:
            raise ValueError(f"watermark_blocks must be in [0, num_blocks={num_blocks}), got {watermark_blocks!r}")
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that it can hold `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int, *, use_watermark: bool = True) -> bool:
        reserve = self.watermark_blocks if use_watermark else 0
        return len(self._free) - reserve >= num_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to hold `num_tokens` tokens. Raises if short: callers check first."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(
                f"out of KV blocks: {seq.seq_id!r} needs {need} more for {num_tokens} tokens, {len(self._free)} free"
            )
        free = self._free
        seq.block_table.extend(free.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks. Idempotent (a freed sequence has an empty table)."""
        self._free.extend(seq.block_table)
        seq.block_table.clear()

    def check_invariants(self, sequences: Iterable[Sequence]) -> None:
        """For tests: every block is either free or owned by exactly one of `sequences`, never both."""
        owner: dict[int, str] = {}
        for seq in sequences:
            for block in seq.block_table:
                if block in owner:
                    raise AssertionError(f"block {block} owned by both {owner[block]!r} and {seq.seq_id!r}")
                owner[block] = seq.seq_id
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("a block appears twice in the free list")
        both = owner.keys() & set(free)
        if both:
            raise AssertionError(f"blocks {sorted(both)[:5]} are both free and owned")
        if len(owner) + len(free) != self._num_blocks or not all(0 <= b < self._num_blocks for b in free):
            missing = set(range(self._num_blocks)) - owner.keys() - set(free)
            raise AssertionError(f"blocks leaked (neither free nor owned): {sorted(missing)[:5]}")
