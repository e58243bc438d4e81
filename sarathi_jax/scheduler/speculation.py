"""The scheduler's side of speculative decoding: which decodes get draft tokens, and how many.

After a policy has built its batch (every running decode with its one token, prefill chunks, admissions), the
room left under the batch's token limit goes to draft tokens, decode by decode in the queue's order: so
every running decode gets its token before any sequence gets speculative ones, prefill chunks share the
batch as before, and a tight budget shrinks k per sequence (to 0 once the room is spent). Under memory
pressure k is 0: none while this schedule preempted anything, and a draft never takes a block from below
the watermark (nor preempts for one). A sequence's k is also capped by its max_tokens (drafts past it could
never be emitted) and by the step's sampling rows (each draft needs one: chunks + drafts <= max_num_seqs).

Two kinds of proposer: a lookup (`Proposer`, n-gram) is asked per sequence as its room is decided, and may
propose fewer tokens than asked (the rest of the room goes on to the next decode); it also serves a decode
whose last token is pending (the overlapped loop: `ngram_proposer`). A draft model
(`BatchProposer`, `draft_runner`) always proposes as many as asked, so the grants are decided first and the
draft then runs once for all of them, batched, after their blocks are allocated (it writes K/V there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.spec_decode.ngram_proposer import propose_ngram
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.request.sequence import Sequence as Seq
from sarathi_jax.spec_decode.speculative import SpeculativeConfig, speculates

Proposer = Callable[[Seq, int], Sequence[int]]  # (sequence, most tokens) -> draft tokens
# [(sequence, exactly n tokens)] -> each one's n draft tokens, in order
BatchProposer = Callable[[Sequence[tuple[Seq, int]]], Sequence[Sequence[int]]]


class DraftableBatch(Protocol):
    """What `extend` reads and grows of a batch being built (`scheduler.base.Batch`)."""

    items: list[list]  # [seq, num_new_tokens, is_prefill]
    num_tokens: int

    @property
    def room(self) -> int: ...


def ngram_proposer(config: SpeculativeConfig) -> Proposer:
    """Prompt lookup over the tokens on the host. In the overlapped loop a decode's last token may still be
    pending (on the device): the lookup then continues the known tokens, its first token a guess of the
    pending one, and proposes the rest. Verification is exact whatever the drafts are (the target scores the
    chunk as it runs, the pending token read on the device), so a wrong guess only costs acceptance."""
    lo, hi = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(seq: Seq, k: int) -> Sequence[int]:
        pending = seq.num_pending_tokens
        if not pending:
            return propose_ngram(seq.token_ids, k, lo, hi)
        return propose_ngram(seq.token_ids[:-pending], k + pending, lo, hi)[pending:]

    return propose


class Speculation:
    """Grants draft tokens to a batch's decodes (`extend`), from a lookup `propose(seq, k)` or a draft model
    `draft([(seq, n), ...])` (exactly one of the two)."""

    def __init__(self, num_speculative_tokens: int, propose: Proposer | None = None,
                 draft: BatchProposer | None = None) -> None:
        assert (propose is None) != (draft is None), "one proposer"
        self.num_speculative_tokens = num_speculative_tokens
        self.propose, self.draft = propose, draft

    @property
    def overlaps(self) -> bool:
        """Whether a decode whose last token is still pending (the overlapped loop) may get drafts: a lookup
        guesses that token (`ngram_proposer`); a draft model reads it on the host, so the engine core keeps
        requests that may speculate with one synchronous (docs/design/speculative-decoding.md, "The loop")."""
        return self.propose is not None

    def synchronous(self, params: SamplingParams) -> bool:
        """Whether a request needs the synchronous loop: it may get a draft model's drafts."""
        return not self.overlaps and speculates(params)

    @classmethod
    def of(cls, config: SpeculativeConfig, draft: BatchProposer | None = None) -> Speculation:
        """The n-gram lookup, or `draft` for a draft-model method ("self")."""
        if config.method == "ngram":
            return cls(config.num_speculative_tokens, ngram_proposer(config))
        assert draft is not None, f"method {config.method!r} needs its draft runner"
        return cls(config.num_speculative_tokens, draft=draft)

    def extend(self, batch: DraftableBatch, bm: BlockManager, max_num_seqs: int, preempted: bool
               ) -> dict[str, tuple[int, ...]]:
        """Add draft tokens to `batch`'s decodes (their items grow by k), taking blocks from `bm` above its
        watermark; returns each one's drafts by sequence id. None when this schedule `preempted` anything."""
        drafts: dict[str, tuple[int, ...]] = {}
        if preempted:
            return drafts
        bs, rows_left = bm.block_size, max_num_seqs - len(batch.items)
        granted: list[tuple[Seq, int]] = []  # a draft model's grants, proposed together below
        for item in batch.items:
            seq, n, is_prefill = item
            room = min(self.num_speculative_tokens, batch.room, rows_left,
                       seq.max_total_tokens - seq.num_tokens - 1)  # the bonus token may be the last one
            if is_prefill or n != 1 or room < 1 or not speculates(seq.sampling_params):
                continue
            if seq.num_pending_tokens and not self.overlaps:
                continue  # a draft model's first step reads the last token on the host
            proposal = tuple(int(t) for t in self.propose(seq, room))[:room] if self.propose else None
            k = room if proposal is None else len(proposal)
            end = seq.num_computed_tokens + 1 + k  # tokens held once the chunk's K/V is written
            need = bm.blocks_needed(seq, end)
            if need and not bm.can_allocate(need, use_watermark=True):
                k = min(k, len(seq.block_table) * bs - seq.num_computed_tokens - 1)  # what fits
                need = 0
            if k < 1:
                continue
            if need:
                bm.allocate(seq, end)
            item[1] += k
            batch.num_tokens += k
            rows_left -= k
            if proposal is None:
                granted.append((seq, k))
            else:
                drafts[seq.seq_id] = proposal[:k]
        if granted:
            for (seq, k), proposal in zip(granted, self.draft(granted)):
                drafts[seq.seq_id] = tuple(int(t) for t in proposal)
                assert len(drafts[seq.seq_id]) == k, (seq.seq_id, k, proposal)
        return drafts
