"""Scheduler settings: one frozen dataclass, validated on construction against the policies' registry.

It sits above the registry and the scheduler classes, which read it through the `SchedulerSettings` protocol
(scheduler/base.py) and import nothing from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_jax.scheduler.base import SCHEDULING_POLICIES, Scheduler
from sarathi_jax.scheduler.registry import SCHEDULER_POLICIES, SCHEDULERS


@dataclass(frozen=True)
class SchedulerConfig:
    """policy: one of SCHEDULER_POLICIES (sarathi_jax.scheduler.registry).
    token_budget: most tokens (decodes + prefill chunks) per batch for the chunking/hybrid policies.
    max_num_seqs: most sequences per batch, and most sequences admitted (running) at once.
    max_model_len: longest prompt + max_tokens a request may ask for.
    max_num_batched_tokens: most tokens per batch for vllm/orca/faster_transformer, which never split a
        prompt; must be >= max_model_len so any prompt (or a preempted sequence's re-prefill) fits.
        None: max(max_model_len, token_budget).
    tile_size: sarathi only: round each batch's tokens down to a multiple of this by shrinking the last
        prefill chunk (see SarathiScheduler).
    watermark: fraction of KV blocks kept free when admitting new requests.
    scheduling_policy: the order requests are served in, one of SCHEDULING_POLICIES: "fcfs" (arrival),
        "priority" (lower priority value first, then arrival) or "deadline" (earliest TTFT deadline first,
        requests that missed theirs relegated behind the others; see sarathi_jax/scheduler/base.py).
    priority_max_wait_s: "priority" only: aging; a request waiting this many seconds since its arrival is
        served as the most urgent priority. None: no aging.
    max_prefill_share: chunking policies: while other requests wait or prefill, one request's prefill chunk
        takes at most this fraction of the batch's token limit (in (0, 1]), so a long prompt does not hold the
        prefill share for many iterations. None: no cap.
    """

    policy: str = "sarathi"
    token_budget: int = 512
    max_num_seqs: int = 128
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None
    tile_size: int | None = None
    watermark: float = 0.01
    scheduling_policy: str = "fcfs"
    priority_max_wait_s: float | None = 60.0
    max_prefill_share: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULER_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULER_POLICIES}, got {self.policy!r}")
        for name in ("token_budget", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_num_batched_tokens", "tile_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be None or a positive integer, got {value!r}")
        if not isinstance(self.watermark, (int, float)) or not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        check_scheduling_policy(self.scheduling_policy, self.priority_max_wait_s)
        check_prefill_share(self.max_prefill_share)
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", max(self.max_model_len, self.token_budget))
        uses_token_budget = self.scheduler_class.uses_token_budget
        if not uses_token_budget and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) under policy {self.policy!r}, which never splits a prompt"
            )
        # Every running sequence may need one decode token in the same batch: the batch limit must hold them.
        if self.batch_token_limit < self.max_num_seqs:
            limit_name = "token_budget" if uses_token_budget else "max_num_batched_tokens"
            raise ValueError(
                f"{limit_name} ({self.batch_token_limit}) must be >= max_num_seqs ({self.max_num_seqs}) under "
                f"policy {self.policy!r}: each running sequence needs a decode token per batch"
            )

    @property
    def scheduler_class(self) -> type[Scheduler]:
        """The policy's class."""
        return SCHEDULERS[self.policy]

    @property
    def batch_token_limit(self) -> int:
        """The token limit of a normal batch under this policy."""
        return self.token_budget if self.scheduler_class.uses_token_budget else self.max_num_batched_tokens


def check_scheduling_policy(scheduling_policy: str, priority_max_wait_s: float | None) -> None:
    """ValueError unless `scheduling_policy` is known and `priority_max_wait_s` None or a positive number
    (`EngineConfig` checks the same before anything loads)."""
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
    wait = priority_max_wait_s
    if wait is not None and (not isinstance(wait, (int, float)) or isinstance(wait, bool) or not wait > 0):
        raise ValueError(f"priority_max_wait_s must be None or a positive number of seconds, got {wait!r}")


def check_prefill_share(share: float | None) -> None:
    """ValueError unless `share` is None or a number in (0, 1]."""
    if share is not None and (not isinstance(share, (int, float)) or isinstance(share, bool)
                              or not 0.0 < share <= 1.0):
        raise ValueError(f"max_prefill_share must be None or a number in (0, 1], got {share!r}")
