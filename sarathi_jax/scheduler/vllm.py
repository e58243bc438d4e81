"""vLLM v0 (no chunked prefill): prefill-prioritizing, whole prompts."""

from __future__ import annotations

from sarathi_jax.scheduler.base import Scheduler
from sarathi_jax.request.sequence import Batch


class VLLMScheduler(Scheduler):
    """Admit whole prompts FCFS while memory (blocks for the whole prompt, keeping the watermark),
    `max_num_seqs` and `max_num_batched_tokens` allow. If any prompt was admitted the batch is prefill-only;
    otherwise it holds every running decode. Decodes therefore stall while new prompts keep arriving (the
    generation stalls Sarathi-Serve removes). Running sequences grow block by block and are preempted by
    recompute when memory runs out.
    """

    name = "vllm"
    admission = "prompt"
    uses_token_budget = False
    chunks_prompts = False

    def _schedule(self) -> Batch:
        batch = self._new_batch()
        if self._admit(batch, chunked=False):
            return batch
        self._schedule_decodes(batch)
        return batch
