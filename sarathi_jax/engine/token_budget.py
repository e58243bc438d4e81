"""An engine's token budget set up: the one sizing-and-budget sequence every engine runs (`plan_engine`), and for
token_budget "auto" and "dynamic" the cost model they predict with and what they resolve to. The budget rules
themselves are plain Python in `scheduler/budget.py`.

The cost model (`BucketCostModel`) comes from, in this order: `EngineConfig.cost_profile` (a saved JSON), the
cache beside the compilation cache (`<compilation cache>/sarathi-cost-models/<key>.json`, the key naming the
model, dtype, attention backend, device kind, layer layout, parallel sizes, block size, buckets and batch
limits: whatever changes a step's time), or a calibration at start-up (`calibrate`): a few timed steps
through the real model runner on every bucket, fitted by least squares and written to that cache.

"auto" picks a budget (`scheduler.budget.pick_auto_budget`) and the engine then runs a fixed budget; "dynamic"
compiles max_token_budget and gives the Sarathi scheduler a `SloTokenBudget`. Either way the engine's config
holds the resolved integer, and `BudgetSetup.describe()` is what the ready line and the bench print. No JAX here:
the runner that calibration times is passed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.sim.cost_model import BucketCostModel, Chunk
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler.budget import (
    REFERENCE_DECODES,
    BudgetChoice,
    IterationFeedback,
    IterationPredictor,
    TILE,
    SloTokenBudget,
    pick_auto_budget,
)
from sarathi_jax.request.sequence import ScheduledChunk, Sequence
from sarathi_jax.config.sizing import EngineSizing, bucket_ladder, platform_buckets, size_engine

if TYPE_CHECKING:
    from sarathi_jax.models.config import ModelConfig

CACHE_SUBDIR = "sarathi-cost-models"
CALIBRATION_REPEATS = 3  # timed runs of each batch (after one untimed); the median is kept
CALIBRATION_CONTEXT = 512  # the decodes' context in the calibration batches (capped by max_model_len and the cache)


@dataclass(frozen=True)
class BudgetSetup:
    """How an engine's token budget was set: `mode` ("fixed", "auto", "dynamic"), `budget` (the resolved
    token_budget: under "dynamic" the compiled maximum), `choice` ("auto"'s pick), `target_s` (slo_tbt_s),
    `cost_model_source` (where the prediction came from), `policy` ("dynamic"'s per-iteration budget)."""

    mode: str
    budget: int
    choice: BudgetChoice | None = None
    target_s: float | None = None
    cost_model_source: str | None = None
    policy: SloTokenBudget | None = None

    def describe(self) -> str:
        if self.mode == "fixed":
            return f"token budget {self.budget}"
        if self.mode == "dynamic":
            assert self.policy is not None
            return (f"token budget dynamic (at most {self.budget}; each iteration's predicted time <= "
                    f"{self.policy.margin:g} x the tightest running TBT target, default {_ms(self.target_s)}, and <= "
                    f"{self.policy.arrival_share:g} x the tightest recent TTFT target; "
                    f"cost model {self.cost_model_source})")
        c = self.choice
        assert c is not None
        verdict = "" if c.meets else ": no budget meets it, the smallest allowed"
        return (f"token budget auto {c.budget} (predicted iteration {_ms(c.predicted_s)} {'<=' if c.meets else '>'} "
                f"{c.margin:g} x TBT target {_ms(c.target_s)}{verdict}; cost model {self.cost_model_source})")

    def as_dict(self) -> dict:
        d: dict[str, Any] = {"mode": self.mode, "budget": self.budget, "target_s": self.target_s,
                             "cost_model_source": self.cost_model_source}
        if self.choice is not None:
            d["predicted_s"], d["meets"] = self.choice.predicted_s, self.choice.meets
        return d


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1e3:.3g} ms"


def resolve(config: EngineConfig, predictor: IterationPredictor | None, source: str | None = None,
            compiled_buckets: SequenceOf[int] | None = None, *, max_model_len: int) -> tuple[EngineConfig, BudgetSetup]:
    """`config` with token_budget an integer, and how it was set. "auto" and "dynamic" need `predictor`;
    `max_model_len` is the engine's (sized), the longest context "auto" must hold the target at.

    A `BucketCostModel` pads a batch to buckets: to `compiled_buckets`, those of an engine already compiled
    (after a start-up calibration) or of the one "dynamic" compiles for max_token_budget; None ("auto" before
    the engine is sized): each candidate B is the top bucket of an engine compiled for B (every multiple of TILE
    a bucket, the fit interpolating between measured ones)."""
    mode = config.token_budget
    if isinstance(mode, int):
        return config, BudgetSetup("fixed", mode)
    assert predictor is not None and config.slo_tbt_s is not None, "auto/dynamic need a cost model and slo_tbt_s"
    top = config.budget_ceiling
    if isinstance(predictor, BucketCostModel):
        predictor = predictor.with_buckets(compiled_buckets or range(TILE, top + 1, TILE))
    if mode == "auto":
        choice = pick_auto_budget(predictor, config.slo_tbt_s, max_budget=top, max_num_seqs=config.max_num_seqs,
                                  max_model_len=max_model_len, margin=config.slo_margin)
        return (dataclasses.replace(config, token_budget=choice.budget),
                BudgetSetup("auto", choice.budget, choice, config.slo_tbt_s, source))
    policy = SloTokenBudget(predictor, max_budget=top, default_slo_tbt_s=config.slo_tbt_s, margin=config.slo_margin,
                            bucket_of=predictor.padded if isinstance(predictor, BucketCostModel) else None)
    return (dataclasses.replace(config, token_budget=top, bucket_ladder=bucket_ladder(config)),
            BudgetSetup("dynamic", top, None, config.slo_tbt_s, source, policy))


def install(setup: BudgetSetup, scheduler: Any, iteration_log: SequenceOf[Any]) -> None:
    """Give the scheduler "dynamic"'s per-iteration budget (the config check made it the sarathi policy), with
    the engine core's iteration log for its measured slack (`scheduler.budget.IterationFeedback`)."""
    if setup.policy is not None:
        setup.policy.feedback = IterationFeedback(iteration_log)
        scheduler.budget_policy = setup.policy


@dataclass(frozen=True)
class EnginePlan:
    """What the sizing-and-budget sequence decided: `config` with token_budget an integer (the resolved budget, or
    the ceiling while a calibration is pending), the engine's `sizing` under it, and how the budget was set
    (`budget_setup`; None: "auto"/"dynamic" found no cost model, and the engine resolves after calibrating)."""

    config: EngineConfig
    sizing: EngineSizing
    budget_setup: BudgetSetup | None


PredictorFor = Callable[[tuple[int, ...]], tuple[IterationPredictor | None, str | None]]


def plan_engine(config: EngineConfig, model_config: ModelConfig, kv_cache_bytes: int | None, platform: str,
                predictor_for: PredictorFor) -> EnginePlan:
    """The one sizing-and-budget sequence of every engine: the real one (and each instance of a disaggregated
    one), the simulated one and the simulated disaggregated one.

    A fixed budget sizes the engine at once. "auto" and "dynamic" first size it at the budget ceiling, on its
    bucket ladder (pinned), take the buckets that engine compiles on `platform`, and ask `predictor_for(buckets)`
    for a cost model and its source: with one, the budget resolves (`resolve`; "dynamic" pads to those buckets)
    and the engine is sized again at the resolved budget; with none, it stays sized at the ceiling. `platform`
    picks the buckets only: sizing reads `config.dtype` as resolved (a device-less caller's "auto" is a CPU's)."""
    if isinstance(config.token_budget, int):
        return EnginePlan(config, size_engine(config, model_config, kv_cache_bytes),
                          BudgetSetup("fixed", config.token_budget))
    top = dataclasses.replace(config, token_budget=config.budget_ceiling, bucket_ladder=bucket_ladder(config))
    top_sizing = size_engine(top, model_config, kv_cache_bytes)
    buckets = platform_buckets(top_sizing.max_step_tokens, platform, top.bucket_ladder)
    predictor, source = predictor_for(buckets)
    if predictor is None:
        return EnginePlan(top, top_sizing, None)
    config, setup = resolve(config, predictor, source, buckets if config.token_budget == "dynamic" else None,
                            max_model_len=top_sizing.max_model_len)
    return EnginePlan(config, size_engine(config, model_config, kv_cache_bytes), setup)


# ----------------------------------------------------------------------------------------------- the cost model


def cache_path(cache_dir: str | None, config: EngineConfig, device_kind: str, buckets: SequenceOf[int]) -> Path | None:
    """Where the calibrated cost model of this configuration on this device is cached (None: no cache)."""
    if cache_dir is None:
        return None
    model = config.model
    if os.path.isdir(model):  # a folder: its weights' identity, not just its path
        stamp = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in sorted(Path(model).glob("*"))
                 if p.is_file()]
        model = f"{model}:{stamp}"
    key = json.dumps([model, config.dtype, config.attention_backend, device_kind, config.scan_layers,
                      config.tensor_parallel_size, config.pipeline_parallel_size, config.block_size,
                      list(buckets), config.max_num_seqs, CALIBRATION_CONTEXT])
    return Path(cache_dir) / CACHE_SUBDIR / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def saved_cost_model(config: EngineConfig, path: Path | None) -> tuple[BucketCostModel | None, str | None]:
    """The cost model of `config.cost_profile` (errors raised: the user named it), else the cached one at
    `path` (ignored when unreadable), else None."""
    if config.cost_profile is not None:
        try:
            return BucketCostModel.load(os.fspath(config.cost_profile)), f"profile {config.cost_profile}"
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"cost_profile {config.cost_profile}: {type(e).__name__}: {e}") from None
    if path is not None and path.is_file():
        try:
            return BucketCostModel.load(os.fspath(path)), f"cached {path}"
        except (OSError, KeyError, TypeError, ValueError):
            return None, None
    return None, None


def save_cost_model(model: BucketCostModel, path: Path | None) -> str:
    """Write the calibrated model to the cache (best effort); the source words for reports."""
    if path is None:
        return "calibrated at start-up (not cached: no compilation cache)"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(model.to_dict()))
        tmp.replace(path)
    except OSError as e:
        return f"calibrated at start-up (not cached: {e})"
    return f"calibrated at start-up, cached {path}"


class StepRunner(Protocol):
    """What calibration times: the model runner's `execute` (dispatch and wait)."""

    buckets: tuple[int, ...]

    def execute(self, chunks: SequenceOf[ScheduledChunk], sampling_of: Any) -> Any: ...


def calibration_batches(buckets: SequenceOf[int], max_num_seqs: int, max_len: int, free_blocks: int,
                        block_size: int) -> list[list[Chunk]]:
    """Batches that fill each bucket three ways: a fresh prefill; decodes at a context with a prefill chunk
    making up the rest; and a chunk late in a prompt. Sequences stay within `max_len` tokens, and each batch
    within `free_blocks` KV blocks."""
    out = []
    for b in buckets:
        if b > max_len or -(-b // block_size) > free_blocks:
            continue
        d = min(REFERENCE_DECODES, max_num_seqs - 1, b // 2)  # and a prefill chunk: max_num_seqs sequences
        room = (free_blocks - -(-b // block_size)) // max(d, 1) * block_size - 1  # each decode's context
        context = min(CALIBRATION_CONTEXT, max_len - b - 1, room)
        out.append([Chunk(0, b)])
        if context >= 1 and d:
            out.append([Chunk(context, 1) for _ in range(d)] + ([Chunk(0, b - d)] if b > d else []))
            out.append([Chunk(context, b)])
    return out


def calibrate(runner: StepRunner, block_manager: Any, max_num_seqs: int, max_len: int,
              source: dict | None = None) -> BucketCostModel:
    """Time `calibration_batches` on the runner (fake sequences holding real KV blocks, freed afterwards) and
    fit a `BucketCostModel` to the medians."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    batches = calibration_batches(runner.buckets, max_num_seqs, max_len, block_manager.num_free_blocks,
                                  block_manager.block_size)
    seqs: list[Sequence] = []

    def scheduled(batch: list[Chunk]) -> list[ScheduledChunk]:
        out = []
        for c in batch:
            seq = Sequence(f"calibrate-{len(seqs)}", [3] * c.end, params, 0.0)
            block_manager.allocate(seq, c.end)
            seqs.append(seq)
            out.append(ScheduledChunk(seq, c.num_new_tokens, c.start))
        return out

    sampling_of = lambda seq: (params, 0, ())  # noqa: E731
    times = []
    try:
        for batch in batches:
            chunks = scheduled(batch)
            runner.execute(chunks, sampling_of)  # untimed: first-use costs
            samples = []
            for _ in range(CALIBRATION_REPEATS):
                t0 = time.perf_counter()
                runner.execute(chunks, sampling_of)
                samples.append(time.perf_counter() - t0)
            times.append(statistics.median(samples))
            for s in seqs:
                block_manager.free(s)
            seqs.clear()
    finally:
        for s in seqs:
            block_manager.free(s)
    return BucketCostModel.fit(batches, times, runner.buckets, source=source)
