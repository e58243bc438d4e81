"""FasterTransformer-style request-level batching."""

from __future__ import annotations

from sarathi_jax.scheduler.base import Scheduler
from sarathi_jax.request.sequence import Batch
from sarathi_jax.request.sequence import SequenceStatus


class FasterTransformerScheduler(Scheduler):
    """Only when nothing is running, admit a batch FCFS: up to `max_num_seqs` requests, each reserving KV
    blocks for prompt + max_tokens (so nothing is ever preempted). Run that batch until every request in it
    has finished: first prefill iterations (whole prompts, as many as fit `max_num_batched_tokens` per
    iteration; decodes of the batch wait until all its prompts are done), then decode iterations. Finished
    requests leave their slot empty; new requests wait for the whole batch.
    """

    name = "faster_transformer"
    admission = "request"
    uses_token_budget = False
    chunks_prompts = False

    def _schedule(self) -> Batch:
        bm = self.block_manager
        if not self._running:
            while self._waiting and len(self._running) < self.config.max_num_seqs:
                seq = self._waiting[0]
                hit = bm.match_prefix(seq)
                if not bm.can_allocate(self._admission_blocks(seq.max_total_tokens, hit)):
                    break
                self._admit_seq(seq, seq.max_total_tokens, hit)
        batch = self._new_batch()
        self._schedule_running_prefills(batch, chunked=False)
        if batch or any(s.status is SequenceStatus.RUNNING and not s.is_decode for s in self._running):
            return batch  # context phase of the batch not done yet: no decodes
        self._schedule_decodes(batch)
        return batch
