"""Sarathi-Serve: stall-free batching with chunked prefills under a token budget."""

from __future__ import annotations

from sarathi_jax.scheduler.base import Scheduler
from sarathi_jax.request.sequence import Batch
from sarathi_jax.scheduler.budget import BudgetPolicy


class SarathiScheduler(Scheduler):
    """Each batch, within `token_budget` tokens and `max_num_seqs` sequences:
    1. every running decode (so ongoing generations never stall behind prefills),
    2. the next chunk of prompts already being prefilled (earliest first), then
    3. new requests admitted FCFS, each prompt chunk sized to what is left of the budget.
    KV blocks are taken only as chunks are scheduled. With `tile_size`, the batch's total tokens are rounded
    down to a multiple of it by shrinking the last prefill chunk, when that chunk is longer than the excess
    (decodes are never dropped, and no chunk is shrunk to 0: otherwise the batch stays unaligned).
    """

    name = "sarathi"
    admission = "chunk"
    uses_token_budget = True
    chunks_prompts = True
    # token_budget="dynamic": asked each iteration for its token limit, at most token_budget (the compiled
    # maximum) and at least the ready decodes (scheduler/budget.py); None: token_budget every iteration.
    budget_policy: BudgetPolicy | None = None

    def _schedule(self) -> Batch:
        decodes, prefills = self._ready_running()  # one snapshot for both passes: neither admits anything
        policy = self.budget_policy
        batch = self._new_batch(None if policy is None else
                                min(policy.token_limit(self._running, decodes, prefills), self.batch_token_limit))
        self._schedule_decodes(batch, decodes)
        self._schedule_running_prefills(batch, prefills, chunked=True)
        self._admit(batch, chunked=True)
        if self.config.tile_size:
            _align_to_tile(batch, self.config.tile_size)
        if policy is not None:
            batch.prediction = policy.scheduled(batch)
        return batch


def _align_to_tile(batch: Batch, tile: int) -> None:
    excess = batch.num_tokens % tile
    if not excess:
        return
    for item in reversed(batch.items):
        if item[2]:  # the last prefill chunk; its extra blocks stay allocated and get used by later chunks
            if item[1] > excess:
                item[1] -= excess
                batch.num_tokens -= excess
            return
