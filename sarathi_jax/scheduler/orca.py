"""Orca: iteration-level scheduling with hybrid batches of decodes and whole prompts."""

from __future__ import annotations

from sarathi_jax.scheduler.base import Scheduler
from sarathi_jax.request.sequence import Batch


class OrcaScheduler(Scheduler):
    """Each batch: every running decode, then whole new prompts FCFS while the batch stays within
    `max_num_batched_tokens` and `max_num_seqs`. At admission a request reserves KV blocks for its whole
    possible length, prompt + max_tokens (which admission already bounds by max_model_len; Orca itself
    reserves max_model_len outright), so running sequences never need a block and nothing is preempted.
    A long prompt in a batch delays all its decodes (hybrid batches, but no chunking).
    """

    name = "orca"
    admission = "request"
    uses_token_budget = False
    chunks_prompts = False

    def _schedule(self) -> Batch:
        batch = self._new_batch()
        self._schedule_decodes(batch)
        self._admit(batch, chunked=False)
        return batch
