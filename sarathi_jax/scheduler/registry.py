"""Policy name -> scheduler class."""

from __future__ import annotations

from sarathi_jax.block_manager import BlockManager
from sarathi_jax.scheduler.base import Scheduler
from sarathi_jax.scheduler.chunked_prefills_only import ChunkedPrefillsOnlyScheduler
from sarathi_jax.scheduler.config import SCHEDULER_POLICIES, SchedulerConfig
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
assert tuple(SCHEDULERS) == SCHEDULER_POLICIES


def make_scheduler(config: SchedulerConfig, block_manager: BlockManager) -> Scheduler:
    cls = SCHEDULERS.get(config.policy)
    if cls is None:
        raise ValueError(f"unknown scheduler policy {config.policy!r}; choose one of {SCHEDULER_POLICIES}")
    return cls(config, block_manager)
