"""Ablation (Sarathi-Serve paper, Table 4): hybrid batching without chunked prefills."""

from __future__ import annotations

from sarathi_jax.scheduler.base import Scheduler
from sarathi_jax.request.sequence import Batch


class HybridBatchingOnlyScheduler(Scheduler):
    """Each batch: every running decode, then WHOLE prompts admitted FCFS while they fit in what is left of
    `token_budget` (memory for the whole prompt, keeping the watermark). A prompt longer than `token_budget`
    can never fit a normal batch: when it reaches the head of the queue and memory allows, it runs alone in a
    prefill-only batch of its own length (the decodes wait that one iteration).
    """

    name = "hybrid_batching_only"
    admission = "prompt"
    uses_token_budget = True
    chunks_prompts = False

    def _schedule(self) -> Batch:
        head = self._waiting[0] if self._waiting else None
        head_tokens = head.num_tokens - self.block_manager.match_prefix(head).num_tokens if head else 0
        if head_tokens > self.config.token_budget:  # what it prefills past its cached prefix
            alone = self._new_batch(token_limit=head_tokens)
            alone.max_seqs = 1
            if self._admit(alone, chunked=False):
                return alone
        batch = self._new_batch()
        self._schedule_decodes(batch)
        self._admit(batch, chunked=False)
        return batch
