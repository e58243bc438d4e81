"""Discrete-event serving simulator: the real schedulers and block manager, a cost model instead of a model.

`SimulatedEngine` has the engine API (docs/design/core.md) on a virtual clock: it is the engine's own core
(`sarathi_jax.core.engine_core.EngineCore`: scheduler, block manager, postprocessing, outputs) driving
`CostModelExecutor`, whose batches advance a `VirtualClock` by the cost model's time and sample dummy tokens.
`simulate()` feeds a trace of timed arrivals through the driver loop the bench uses (`sarathi_jax.core.arrival_loop`). Requests go through the engine's own admission
(`sarathi_jax.core.admission`), so the simulator refuses what `LLMEngine` refuses, with the same error, except text
prompts (no tokenizer: it takes token ids or a prompt length). Stop conditions: those of the engine; dummy
tokens never hit an EOS (the simulator has none) or a stop token unless asked, and have no text, so stop
strings are accepted (as the engine the simulator stands for accepts them) and never match. No JAX.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from collections.abc import Sequence as Sequence_

from sarathi_jax.core.admission import Admission, KVCapacity, Prompt
from sarathi_jax.core.arrival_loop import Arrival, drive
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.core.engine_core import CoreFrontEnd, EngineCore, LoopConfig
from sarathi_jax.models.presets import LLAMA2_VOCAB_SIZE
from sarathi_jax.request.outputs import IterationRecord, RequestOutput
from sarathi_jax.utils.percentiles import percentile
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import ScheduledChunk, SchedulerConfig, SchedulerOutput, make_scheduler

DUMMY_VOCAB = LLAMA2_VOCAB_SIZE  # the default vocabulary: dummy tokens are drawn below it


def dummy_prompt(length: int, vocab_size: int) -> list[int]:
    """Made-up token ids below `vocab_size` for a prompt of `length` tokens (none for a length < 1)."""
    return [(7 * i + 1) % vocab_size for i in range(length)]


class IterationCost(Protocol):
    """What the simulator needs of a cost model (`CostModel`, `sarathi_jax.sim.cost_model.BucketCostModel`)."""

    def iteration_time(self, output: SchedulerOutput) -> float: ...

    def padded(self, num_tokens: int) -> int: ...


@dataclass(frozen=True)
class CostModel:
    """Iteration time (seconds) = overhead + prefill_token_s * prefill tokens + decode_token_s * decode tokens
    + attention_s * sum over chunks of q_len * kv_len (kv_len: the sequence's tokens in the cache after the
    chunk, so a decode at context c costs c units and a whole prompt of p tokens p * p).

    The defaults are loosely a 7B-class model on one mid-size GPU: ~10 ms per iteration whatever the batch
    (reading the weights, launches, sampling), 50 us per prefill token (~20k prefill tokens/s once batches are
    large), 100 us per decode token (its KV reads), and attention that matters only for long contexts. So a
    decode-only iteration of a few dozen sequences takes ~12 ms and a full 512-token hybrid batch ~38 ms:
    enough to reproduce the paper's directions (generation stalls, batching efficiency), not absolute numbers.
    """

    overhead_s: float = 10e-3
    prefill_token_s: float = 5e-5
    decode_token_s: float = 1e-4
    attention_s: float = 2e-9

    def __post_init__(self) -> None:
        for name in ("overhead_s", "prefill_token_s", "decode_token_s", "attention_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def padded(self, num_tokens: int) -> int:
        """The token count a batch runs at: this model has no buckets, so no padding."""
        return num_tokens

    def mixed_batch_time(self, decode_positions: Sequence_[int], prefill_start: int, prefill_tokens: int) -> float:
        """Seconds for decodes at `decode_positions` and one prefill chunk (the token budgets' predictor,
        `scheduler.budget.IterationPredictor`): the same terms as `iteration_time`."""
        units = sum(p + 1 for p in decode_positions) + prefill_tokens * (prefill_start + prefill_tokens)
        return (self.overhead_s + self.prefill_token_s * prefill_tokens
                + self.decode_token_s * len(decode_positions) + self.attention_s * units)

    def iteration_time(self, output: SchedulerOutput) -> float:
        attention_units = sum(c.num_new_tokens * (c.start_position + c.num_new_tokens) for c in output.chunks)
        return (
            self.overhead_s
            + self.prefill_token_s * output.num_prefill_tokens
            + self.decode_token_s * output.num_decode_tokens
            + self.attention_s * attention_units
        )


@dataclass
class _SimulatedBatch:
    """What the cost-model executor "samples": dummy token ids; no logprobs."""

    token_ids: list[int]
    logprobs: None = None
    top_token_ids: None = None
    top_logprobs: None = None


class VirtualClock:
    """Virtual seconds (an `engine_api.Clock`): batches move it forward; waiting jumps it, never back."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def wait_until(self, t: float) -> None:
        self._t = max(self._t, t)


class _SimulatedStep:
    def __init__(self, executor: CostModelExecutor, end: float, token_ids: list[int], num_padded_tokens: int) -> None:
        self._executor, self._end, self._batch = executor, end, _SimulatedBatch(token_ids)
        self.num_padded_tokens = num_padded_tokens

    def result(self) -> _SimulatedBatch:
        """The batch has run once the virtual clock reaches its end."""
        self._executor.clock.wait_until(self._end)
        return self._batch


class CostModelExecutor:
    """The `engine_api.Executor` of the simulator: a batch takes `cost_model.iteration_time` virtual seconds,
    back to back on one virtual device, and samples a dummy token (a function of its position, below
    `vocab_size`)."""

    def __init__(self, cost_model: IterationCost, vocab_size: int = DUMMY_VOCAB) -> None:
        self.cost_model = cost_model
        self.vocab_size = vocab_size
        self.clock = VirtualClock()
        self._device_free_at = 0.0  # when the batches submitted so far are done

    def submit(self, chunks: Sequence_[ScheduledChunk], sampling_of: Any, token_bitmask: Any = None) -> _SimulatedStep:
        start = max(self.clock.now(), self._device_free_at)
        self._device_free_at = end = start + self.cost_model.iteration_time(SchedulerOutput.of(tuple(chunks)))
        tokens = [((c.start_position + c.num_new_tokens) * 7919) % self.vocab_size for c in chunks]
        # BucketCostModel pads like the engine it stands for.
        padded = self.cost_model.padded(sum(c.num_new_tokens for c in chunks))
        return _SimulatedStep(self, end, tokens, padded)

    def now(self) -> float:
        return self.clock.now()


class SimulatedEngine(CoreFrontEnd):
    """The engine API (`engine_api.Engine`) on a virtual clock: the engine core (scheduler, block manager,
    postprocessing, outputs) with a cost model for an executor. Times in RequestMetrics and IterationRecord are
    virtual seconds (`clock`).
    Synchronous by default: a virtual device has no host work to hide. `vocab_size`: the vocabulary that
    admission checks token ids against, and the dummy tokens are drawn from."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        num_blocks: int,
        block_size: int = 16,
        cost_model: IterationCost | None = None,
        *,
        async_scheduling: bool = False,
        enable_prefix_caching: bool = False,
        vocab_size: int = DUMMY_VOCAB,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cost_model = cost_model or CostModel()
        # Off unless asked (unlike EngineConfig): prompts given as lengths are the same made-up ids, so every
        # request would share its prefix with every other.
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = make_scheduler(scheduler_config, self.block_manager)
        self.max_model_len = scheduler_config.max_model_len
        self.config = None  # no EngineConfig: `factory.build_simulated_engine` sizes one like it
        self.budget_setup = None  # token_budget.BudgetSetup: set by `factory.build_simulated_engine`
        self.model_config = None
        self.tokenizer = None
        self.admission = Admission(vocab_size=vocab_size, max_model_len=self.max_model_len,
                                   kv_cache=KVCapacity.of(self.block_manager), stop_strings=True)
        self.executor = CostModelExecutor(self.cost_model, vocab_size)
        self.core = EngineCore(self.scheduler, self.executor, loop=LoopConfig(async_scheduling=async_scheduling))

    @property
    def clock(self) -> VirtualClock:
        return self.executor.clock

    def dummy_prompt(self, length: int) -> list[int]:
        """Made-up token ids for a prompt of `length` tokens (none for a length < 1)."""
        return dummy_prompt(length, self.admission.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt | int,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        *,
        slo_ttft_s: float | None = None,
        slo_tbt_s: float | None = None,
    ) -> None:
        """`prompt` is token ids or just a length (`dummy_prompt`; a length < 1 is an empty prompt).
        Raises AdmissionError (a ValueError) naming the bad field, as `LLMEngine.add_request` does."""
        if isinstance(prompt, int):
            prompt = self.dummy_prompt(prompt)
        super().add_request(request_id, prompt, params, arrival_time, priority, slo_ttft_s=slo_ttft_s,
                            slo_tbt_s=slo_tbt_s)

    def stats(self) -> dict:
        return {**self.core.stats(), "clock": self.clock.now()}

    def pipeline_stats(self) -> None:
        """No pipeline: one virtual device."""
        return None

    def reset_pipeline_stats(self) -> None:
        """Nothing to reset (no pipeline)."""

    def startup_stats(self) -> None:
        """No start-up to report: nothing loads or compiles."""
        return None


# ------------------------------------------------------------------------------------------ traces and runs


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0  # lower is served first under scheduling_policy="priority"
    slo_ttft_s: float | None = None  # the request's own SLO targets (outputs.RequestMetrics)
    slo_tbt_s: float | None = None


@dataclass
class SimulationResult:
    outputs: dict[str, RequestOutput]  # the final output of every request, by id
    iteration_log: list[IterationRecord]
    makespan: float  # virtual time when the last request finished
    num_preemptions: int
    stats: dict = field(default_factory=dict)


def poisson_trace(
    num_requests: int,
    rate: float,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> list[SimRequest]:
    """Poisson arrivals at `rate` requests/s; prompt and output lengths uniform in the inclusive ranges."""
    rng = random.Random(seed)
    t, trace = 0.0, []
    for i in range(num_requests):
        t += rng.expovariate(rate)
        trace.append(SimRequest(f"r{i}", t, rng.randint(*prompt_len), rng.randint(*output_len)))
    return trace


def simulate(
    requests: list[SimRequest],
    scheduler_config: SchedulerConfig,
    *,
    num_blocks: int,
    block_size: int = 16,
    cost_model: IterationCost | None = None,
    max_steps: int | None = None,
) -> SimulationResult:
    """Feed `requests` by arrival time on the virtual clock (idle time jumps to the next arrival) and run
    until all finish. Requests arriving during an iteration join when it ends. A request that admission
    refuses (one that could never fit) raises its AdmissionError."""
    engine = SimulatedEngine(scheduler_config, num_blocks, block_size, cost_model)
    arrivals = [Arrival(r.request_id, r.arrival_time, engine.dummy_prompt(r.num_prompt_tokens),
                        SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), r.priority, r.slo_ttft_s,
                        r.slo_tbt_s)
                for r in sorted(requests, key=lambda r: r.arrival_time)]
    final = drive(engine, arrivals, raise_refused=True, max_steps=max_steps).finished
    makespan = max((o.metrics.finished_time or 0.0 for o in final.values()), default=0.0)
    return SimulationResult(final, engine.iteration_log, makespan, engine.scheduler.num_preemptions, engine.stats())


def summarize(result: SimulationResult) -> dict:
    """Latency and throughput of a run: TBT / TTFT percentiles (s), requests/s and output tokens/s over the
    makespan (first arrival to last finish)."""
    done = [o for o in result.outputs.values() if o.finish_reason == "length"]
    tbts = [t for o in done for t in o.metrics.tbts]
    ttfts = [o.metrics.ttft for o in done if o.metrics.ttft is not None]
    first = min((o.metrics.arrival_time for o in result.outputs.values()), default=0.0)
    span = max(result.makespan - first, 1e-9)
    return {
        "num_finished": len(done),
        "p50_tbt": percentile(tbts, 50),
        "p99_tbt": percentile(tbts, 99),
        "max_tbt": max(tbts, default=float("nan")),
        "p50_ttft": percentile(ttfts, 50),
        "p99_ttft": percentile(ttfts, 99),
        "makespan": span,
        "requests_per_s": len(done) / span,
        "output_tokens_per_s": sum(len(o.token_ids) for o in done) / span,
        "num_preemptions": result.num_preemptions,
    }
