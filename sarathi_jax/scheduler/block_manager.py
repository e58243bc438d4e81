"""Paged KV-cache block allocation with automatic prefix caching, host side (no JAX).

Blocks are ids 0..num_blocks-1 into the device KV pages. A sequence's `block_table` lists its blocks in
position order: token at position p lives in block `block_table[p // block_size]`, slot `p % block_size`.

Prefix caching (`enable_prefix_caching`): a full block whose K/V are computed is registered under a content
hash, `block_hash(parent block's hash, its token ids)`, so the hash names the whole prefix up to the block's
end. Blocks carry reference counts; several sequences may share a block (only ever a full, registered one,
which nobody writes again). A block nobody references stays registered and "evictable": it counts as free,
and is reused (evicted, hash dropped) least recently freed first when a fresh block is needed and the plain
free list is empty. At admission the scheduler asks `match_prefix` for the leading registered blocks of a
sequence and starts it after them (`acquire_prefix`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from sarathi_jax.request.sequence import Sequence

# The parent hash of a sequence's first block. Anything else that changes a block's K/V (a LoRA adapter, a
# cache salt) would be mixed in here; this engine has no such state.
_ROOT_HASH = hashlib.sha256(b"sarathi-jax prefix cache v1").digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Content hash of a full block: its parent's hash and its tokens (SHA-256: collisions would silently
    hand one request another's K/V, so no cheap, forgeable hash)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


@dataclass(frozen=True)
class PrefixHit:
    """The leading registered blocks of a waiting sequence: `blocks` hold its first `num_tokens` tokens;
    `num_evictable` of them are referenced by nobody now (taking them lowers the free count)."""

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    num_evictable: int = 0


NO_HIT = PrefixHit()


class BlockManager:
    """Free list of KV blocks, reference counts, and the prefix cache.

    `watermark_blocks` stay free when admitting new work (`can_allocate(..., use_watermark=True)`), so that
    running sequences can still grow a little before anything has to be preempted; growth of running
    sequences (`use_watermark=False`) may dip into them. Free counts include evictable cached blocks.
    """

    def __init__(
        self, num_blocks: int, block_size: int = 16, watermark_blocks: int = 0, *, enable_prefix_caching: bool = False
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(watermark_blocks, int) or not 0 <= watermark_blocks < num_blocks:
            raise ValueError(f"watermark_blocks must be in [0, num_blocks={num_blocks}), got {watermark_blocks!r}")
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced and unregistered
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks  # registered blocks' hashes
        self._cached: dict[bytes, int] = {}  # hash -> registered block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; oldest first
        self.num_prefix_queries = 0  # tokens of admitted sequences looked up (vLLM's prefix_cache_queries)
        self.num_prefix_hits = 0  # of those, tokens found cached (vLLM's prefix_cache_hits)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, referenced or not."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return self._hash_of[block] is not None

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that it can hold `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int, *, use_watermark: bool = True) -> bool:
        reserve = self.watermark_blocks if use_watermark else 0
        return self.num_free_blocks - reserve >= num_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to hold `num_tokens` tokens. Raises if short: callers check first."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(
                f"out of KV blocks: {seq.seq_id!r} needs {need} more for {num_tokens} tokens, "
                f"{self.num_free_blocks} free"
            )
        for _ in range(need):
            block = self._free.popleft() if self._free else self._evict()
            self._ref[block] = 1
            seq.block_table.append(block)

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._hash_of[block]]
        self._hash_of[block] = None
        return block

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks, registering its computed full blocks first (so a preempted or
        finished sequence leaves its prefix behind). Idempotent (a freed sequence has an empty table)."""
        self.cache_full_blocks(seq)
        # Last block first: a sequence's tail is the least likely to be shared, so it is evicted first.
        for block in reversed(seq.block_table):
            self._ref[block] -= 1
            assert self._ref[block] >= 0, f"block {block} freed more often than taken"
            if self._ref[block] == 0:
                if self._hash_of[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None
        seq.block_table = []  # a new list, never the old one cleared: the runner knows a live table by identity
        seq.num_registered_blocks = 0

    def retake(self, seq: Sequence, blocks: list[int]) -> None:
        """Give `seq` (holding none) these blocks, which a finished sequence has just freed: they still hold its
        K/V, because nothing was allocated since (a disaggregated prefill instance holds a prompt's blocks until
        they have moved; sarathi_jax/disagg/flow.py). A block still referenced (a shared prefix) or
        cached keeps its registration."""
        assert not seq.block_table, seq
        for block in blocks:
            # Free, or a shared (registered) prefix: an unregistered block in use went to another request since.
            assert self._ref[block] == 0 or self._hash_of[block] is not None, f"block {block} was taken again"
            if self._ref[block] == 0:
                if block in self._evictable:
                    del self._evictable[block]
                else:
                    self._free.remove(block)
            self._ref[block] += 1
            seq.block_table.append(block)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release `seq`'s blocks past those holding its first `num_tokens` tokens (speculative decoding: the
        rejected drafts' K/V). Those blocks are never registered: registration needs computed, known tokens.
        The table is replaced, not shortened in place: the runner knows a live table by identity and appends."""
        keep = max(self.blocks_for_tokens(num_tokens), seq.num_registered_blocks)
        if keep >= len(seq.block_table):
            return
        for block in reversed(seq.block_table[keep:]):
            assert self._hash_of[block] is None and self._ref[block] == 1, block
            self._ref[block] = 0
            self._free.appendleft(block)  # K/V nobody needs: reused first
        seq.block_table = seq.block_table[:keep]

    # ------------------------------------------------------------------------------------------ prefix cache

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """`seq.block_hashes`, extended to its first `num_blocks` blocks (whose tokens the caller knows)."""
        hashes, tokens, bs = seq.block_hashes, seq.token_ids, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else _ROOT_HASH, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def match_prefix(self, seq: Sequence) -> PrefixHit:
        """The leading registered blocks of `seq` (which holds no blocks). Never its last token: a sequence
        recomputes at least that one, for logits to sample from, and only ever into a block of its own."""
        if not self.enable_prefix_caching:
            return NO_HIT
        known = seq.num_tokens - seq.num_pending_tokens
        limit = min(seq.num_tokens - 1, known) // self.block_size
        blocks = []
        for h in self._block_hashes(seq, limit):
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        if not blocks:
            return NO_HIT
        evictable = sum(1 for b in blocks if self._ref[b] == 0)
        return PrefixHit(tuple(blocks), len(blocks) * self.block_size, evictable)

    def acquire_prefix(self, seq: Sequence, hit: PrefixHit) -> None:
        """Start `seq`'s empty block table with `hit` (from `match_prefix` just now) and count the lookup."""
        assert not seq.block_table, seq
        if not self.enable_prefix_caching:
            return
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += hit.num_tokens
        for block in hit.blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
        seq.block_table.extend(hit.blocks)
        seq.num_registered_blocks = len(hit.blocks)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s full blocks whose K/V are computed (`num_computed_tokens`: the batch that wrote
        them is dispatched, and the device runs batches in order) and whose tokens are known (no pending
        placeholder). A block whose content is already registered elsewhere stays private."""
        if not self.enable_prefix_caching:
            return
        if seq.num_computed_tokens < (seq.num_registered_blocks + 1) * self.block_size:
            return  # no block past the registered ones is computed full yet: most steps of a decode
        known = min(seq.num_computed_tokens, seq.num_tokens - seq.num_pending_tokens)
        full = min(known // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        hashes = self._block_hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block, h = seq.block_table[i], hashes[i]
            if h not in self._cached and self._hash_of[block] is None:
                self._cached[h] = block
                self._hash_of[block] = h
        seq.num_registered_blocks = full

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (e.g. after new weights): evictable blocks become plain free ones,
        blocks in use go to the free list when released. Lookup statistics are kept."""
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        for block in self._cached.values():
            self._hash_of[block] = None
        self._cached.clear()

    # ------------------------------------------------------------------------------------------ tests

    def check_invariants(self, sequences: Iterable[Sequence]) -> None:
        """For tests: each block is free (plain or evictable) or referenced exactly as often as the tables of
        `sequences` hold it; shared blocks are registered; the hash map and the blocks agree."""
        owners: dict[int, list[str]] = {}
        for seq in sequences:
            for block in seq.block_table:
                owners.setdefault(block, []).append(seq.seq_id)
        for block, ids in owners.items():
            if len(ids) != self._ref[block]:
                raise AssertionError(f"block {block} owned by {ids} but referenced {self._ref[block]} times")
            if len(ids) > 1 and self._hash_of[block] is None:
                raise AssertionError(f"block {block} shared by {ids} but not registered")
        free = list(self._free) + list(self._evictable)
        if len(set(free)) != len(free):
            raise AssertionError("a block appears twice in the free lists")
        both = owners.keys() & set(free)
        if both:
            raise AssertionError(f"blocks {sorted(both)[:5]} are both free and owned")
        if any(self._ref[b] for b in free) or any(self._hash_of[b] is not None for b in self._free):
            raise AssertionError("a free block is referenced, or a plain free block is registered")
        if any(self._hash_of[b] is None for b in self._evictable):
            raise AssertionError("an evictable block is not registered")
        if {b: h for h, b in self._cached.items()} != {b: h for b, h in enumerate(self._hash_of) if h is not None}:
            raise AssertionError("the hash map and the blocks' hashes disagree")
        if len(owners) + len(free) != self._num_blocks or not all(0 <= b < self._num_blocks for b in free):
            missing = set(range(self._num_blocks)) - owners.keys() - set(free)
            raise AssertionError(f"blocks leaked (neither free nor owned): {sorted(missing)[:5]}")
