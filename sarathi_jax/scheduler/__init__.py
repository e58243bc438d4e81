"""Schedulers: which tokens of which sequences run in the next iteration. Plain Python, no JAX."""

from sarathi_jax.scheduler.base import Scheduler
from sarathi_jax.request.sequence import Batch
from sarathi_jax.scheduler.config import SchedulerConfig
from sarathi_jax.request.sequence import ScheduledChunk, SchedulerOutput
from sarathi_jax.scheduler.registry import SCHEDULER_POLICIES, SCHEDULERS, make_scheduler

__all__ = [
    "SCHEDULERS",
    "SCHEDULER_POLICIES",
    "Batch",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "make_scheduler",
]
