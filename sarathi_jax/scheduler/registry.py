"""Policy name -> scheduler class, and the policy-name tuples derived from the classes' attributes."""

from __future__ import annotations

from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.scheduler.base import Scheduler, SchedulerSettings
from sarathi_jax.scheduler.chunked_prefills_only import ChunkedPrefillsOnlyScheduler
from sarathi_jax.scheduler.faster_transformer import FasterTransformerScheduler
from sarathi_jax.scheduler.hybrid_batching_only import HybridBatchingOnlyScheduler
from sarathi_jax.scheduler.orca import OrcaScheduler
from sarathi_jax.scheduler.sarathi import SarathiScheduler
from sarathi_jax.scheduler.simple_chunking import SimpleChunkingScheduler
from sarathi_jax.scheduler.vllm import VLLMScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls
    for cls in (
        SarathiScheduler,
        VLLMScheduler,
        OrcaScheduler,
        FasterTransformerScheduler,
        SimpleChunkingScheduler,
        ChunkedPrefillsOnlyScheduler,
        HybridBatchingOnlyScheduler,
    )
}

# Policy names, in the order the docs list them.
SCHEDULER_POLICIES: tuple[str, ...] = tuple(SCHEDULERS)
# Policies whose batches are bounded by `token_budget`; the others put whole prompts into a batch and are
# bounded by `max_num_batched_tokens` (see Scheduler.uses_token_budget).
TOKEN_BUDGET_POLICIES: tuple[str, ...] = tuple(n for n, c in SCHEDULERS.items() if c.uses_token_budget)
WHOLE_PROMPT_POLICIES: tuple[str, ...] = tuple(n for n, c in SCHEDULERS.items() if not c.uses_token_budget)
# Policies that split prompts into chunks under the token budget (see Scheduler.chunks_prompts).
CHUNKING_POLICIES: tuple[str, ...] = tuple(n for n, c in SCHEDULERS.items() if c.chunks_prompts)


def make_scheduler(config: SchedulerSettings, block_manager: BlockManager) -> Scheduler:
    cls = SCHEDULERS.get(config.policy)
    if cls is None:
        raise ValueError(f"unknown scheduler policy {config.policy!r}; choose one of {SCHEDULER_POLICIES}")
    return cls(config, block_manager)
