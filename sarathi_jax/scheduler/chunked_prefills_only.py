"""Ablation (Sarathi-Serve paper, Table 4): chunked prefills without hybrid batching."""

from __future__ import annotations

from sarathi_jax.scheduler.base import Scheduler
from sarathi_jax.request.sequence import Batch


class ChunkedPrefillsOnlyScheduler(Scheduler):
    """A batch is either prefill chunks or decodes, never both, and prefill has priority: whenever a running
    prompt is still being prefilled or a waiting request can be admitted, the batch is prefill chunks
    (running prefills first, then FCFS admissions, within `token_budget`); otherwise it is every running
    decode. Chunking bounds each iteration's length, but decodes still stall while prompts are pending.
    """

    name = "chunked_prefills_only"
    admission = "chunk"
    uses_token_budget = True
    chunks_prompts = True

    def _schedule(self) -> Batch:
        batch = self._new_batch()
        self._schedule_running_prefills(batch, chunked=True)
        self._admit(batch, chunked=True)
        if not batch:
            self._schedule_decodes(batch)
        return batch
