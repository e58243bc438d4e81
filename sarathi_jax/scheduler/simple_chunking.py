"""Chunked prefills without hybrid batching, alternating prefill and decode batches."""

from __future__ import annotations

from sarathi_jax.scheduler.base import Scheduler
from sarathi_jax.request.sequence import Batch


class SimpleChunkingScheduler(Scheduler):
    """Batches alternate between kinds: a prefill-only batch (chunks of running prefills, then new requests
    admitted FCFS, all within `token_budget`), then a decode-only batch (every running decode), and so on.
    When the kind whose turn it is has nothing to run, the other kind runs instead (no idle iterations).
    """

    name = "simple_chunking"
    admission = "chunk"
    uses_token_budget = True
    chunks_prompts = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._prefill_turn = True

    def _prefill_batch(self) -> Batch:
        batch = self._new_batch()
        self._schedule_running_prefills(batch, chunked=True)
        self._admit(batch, chunked=True)
        return batch

    def _decode_batch(self) -> Batch:
        batch = self._new_batch()
        self._schedule_decodes(batch)
        return batch

    def _schedule(self) -> Batch:
        kinds = (self._prefill_batch, self._decode_batch)
        first, second = kinds if self._prefill_turn else kinds[::-1]
        ran_prefill = self._prefill_turn
        batch = first()
        if not batch:
            batch, ran_prefill = second(), not ran_prefill
        if batch:
            self._prefill_turn = not ran_prefill
        return batch
