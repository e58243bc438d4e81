"""The engine API that drivers program against: `Engine`, the typing.Protocol that `LLMEngine` and
`SimulatedEngine` both meet (the bench, the driver loop and the servers' engine thread use nothing else), and
the `Clock` an engine stamps its times with: wall time (`WallClock`) for `LLMEngine`, virtual seconds for
`SimulatedEngine`, and below the core, the `Executor` that runs its batches (the model runner, or a cost model
on a virtual clock) with the `StepHandle` and `SampledBatch` it returns. See docs/design/core.md, "The engine API". No JAX.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sarathi_jax.core.admission import Admission, AdmittedRequest, Prompt
    import numpy as np

    from sarathi_jax.config.engine_config import EngineConfig
    from sarathi_jax.request.outputs import IterationRecord, RequestOutput
    from sarathi_jax.request.sampling_params import RequestSampling, SamplingParams
    from sarathi_jax.request.sequence import ScheduledChunk, Sequence


class BudgetSetup(Protocol):
    """How an engine's token budget was set, as drivers read it (`sarathi_jax.engine.token_budget.BudgetSetup`
    is the one there is; named here by its shape, since the engine package sits above this one)."""

    @property
    def mode(self) -> str:
        """One of "fixed", "auto", "dynamic"."""
        ...

    @property
    def budget(self) -> int:
        """The resolved token budget (under "dynamic", the compiled maximum)."""
        ...

    def describe(self) -> str: ...

    def as_dict(self) -> dict: ...


class Clock(Protocol):
    """The time an engine stamps its metrics and iteration records with."""

    def now(self) -> float:
        """Seconds: time.monotonic() for a real engine, virtual seconds for the simulator."""
        ...

    def wait_until(self, t: float) -> None:
        """Let time reach `t` while the engine is idle: a wall clock sleeps, a virtual one jumps forward."""
        ...


class WallClock:
    """time.monotonic(), sleeping to wait (`LLMEngine`'s clock)."""

    def now(self) -> float:
        return time.monotonic()

    def wait_until(self, t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class Engine(Protocol):
    """What a driver needs of an engine: requests in, one iteration per `step()`, outputs and records out.
    One thread drives it (the engine is not thread-safe); admission (`admission.admit`) may run in any."""

    @property
    def clock(self) -> Clock: ...

    @property
    def admission(self) -> Admission:
        """The engine's request rules (vocab_size, max_model_len, tokenizer)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def config(self) -> EngineConfig | None:
        """The configuration the engine was built from (None: a simulator sized by hand)."""
        ...

    @property
    def iteration_log(self) -> list[IterationRecord]: ...

    @property
    def budget_setup(self) -> BudgetSetup | None:
        """How the token budget was set (fixed, or "auto"/"dynamic" from a cost model); None: a simulator
        built from a SchedulerConfig by hand."""
        ...

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, *, slo_ttft_s: float | None = None,
                    slo_tbt_s: float | None = None) -> None:
        """Admit and queue a request: AdmissionError (a ValueError naming the field) when it is refused.
        `priority`: lower is served first under scheduling_policy="priority"; `slo_ttft_s`, `slo_tbt_s`: its SLO
        targets (outputs.RequestMetrics says what they mean and reports whether they were met)."""
        ...

    def add_admitted(self, request_id: str, request: AdmittedRequest, arrival_time: float | None = None) -> None:
        """Queue a request `admission` admitted, under a new id (nothing is re-checked)."""
        ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> dict:
        """num_running, num_waiting, num_free_blocks, num_total_blocks, kv_cache_usage, num_preemptions,
        num_relegations, prefix_cache_queries, prefix_cache_hits (see docs/design/core.md)."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def pipeline_stats(self) -> dict | None:
        """Pipeline accounting since the last `reset_pipeline_stats` (None: the engine has no pipeline)."""
        ...

    def reset_pipeline_stats(self) -> None: ...

    def startup_stats(self) -> dict | None:
        """How start-up went (None: nothing to report, as for the simulator)."""
        ...


class SampledBatch(Protocol):
    """Host arrays of one retired batch; row i is chunk i's. The logprob arrays are None if no row wants them."""

    token_ids: Any  # int[>= num_chunks]
    logprobs: Any  # float[>= num_chunks]
    top_token_ids: Any  # int[>= num_chunks, N]
    top_logprobs: Any  # float[>= num_chunks, N]


class StepHandle(Protocol):
    num_padded_tokens: int  # the token count the batch really runs at (its bucket)

    def result(self) -> SampledBatch:
        """Wait for the batch and return its sampled tokens on the host (cached)."""
        ...


class Executor(Protocol):
    """Runs batches: the model runner on a device, or a cost model on a virtual clock."""

    def submit(self, chunks: SequenceOf[ScheduledChunk], sampling_of: Callable[[Sequence], RequestSampling],
               token_bitmask: np.ndarray | None = None) -> StepHandle:
        """Dispatch one batch without waiting for it. A chunk's tokens may include one pending token (the
        last, `PENDING_TOKEN`), sampled by the batch submitted just before this one. `sampling_of(seq)` gives
        a request's sampling settings; an executor asks for them when the sequence first enters a batch.
        `token_bitmask` (int32 [len(chunks), ceil(V/32)]): the tokens each row may sample; None: any."""
        ...

    def now(self) -> float:
        """The clock that stamps metrics: time.monotonic(), or the simulator's virtual seconds."""
        ...
