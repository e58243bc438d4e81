"""Drive an engine through a workload and collect per-request records and the iteration log.

The driver only uses the Engine API (docs/design.md): `add_request`, `step`, `abort`,
`has_unfinished_requests`, `stats`, `iteration_log`, `model_config`, `max_model_len`.

Real time: a request is added once its arrival time has passed on the engine's clock and is given
`arrival_time = run start + its offset`, so time spent waiting for an engine step in progress counts towards
its latency (as for requests reaching a server mid-step). While the engine is idle the driver sleeps until the
next arrival. Offline runs put every arrival at 0. A virtual-clock engine (the simulator) is driven the same
way on its own clock; while it is idle the driver asks it to jump to the next arrival.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from sarathi_jax.bench.metrics import RequestRecord
from sarathi_jax.bench.workload import Workload
from sarathi_jax.models.presets import LLAMA2_VOCAB_SIZE  # the presets module alone: no JAX
from sarathi_jax.sampling_params import SamplingParams


# ----------------------------------------------------------------------------------------------- clocks


class RealClock:
    """time.monotonic(), sleeping to wait."""

    virtual = False

    def now(self) -> float:
        return time.monotonic()

    def wait_until(self, t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class VirtualClock:
    """An engine's own clock: `now()` reads it; `advance(t)` (when the engine has one) jumps it forward."""

    virtual = True

    def __init__(self, now: Callable[[], float], advance: Callable[[float], Any] | None = None) -> None:
        self._now = now
        self._advance = advance

    def now(self) -> float:
        return float(self._now())

    def wait_until(self, t: float) -> None:
        if self._advance is not None and t > self.now():
            self._advance(t)


def clock_for(engine: Any) -> RealClock | VirtualClock:
    """The clock `engine` stamps its metrics with.

    A virtual-clock engine has `engine.clock`: either a number of virtual seconds that the driver may move
    forward while the engine is idle (SimulatedEngine, whose own `simulate()` does the same), or an object
    with `now()` and optionally `advance_to(t)`. An engine with `now()` (and optionally `advance_to(t)`)
    also counts. Anything else is wall clock (`time.monotonic()`), like LLMEngine.
    """
    c = getattr(engine, "clock", None)
    if isinstance(c, (int, float)) and not isinstance(c, bool):
        def advance(t: float) -> None:
            engine.clock = max(engine.clock, t)

        return VirtualClock(lambda: engine.clock, advance)
    for owner in (c, engine):
        if owner is None or not callable(getattr(owner, "now", None)):
            continue
        adv = getattr(owner, "advance_to", None) or getattr(owner, "advance", None)
        return VirtualClock(owner.now, adv if callable(adv) else None)
    return RealClock()


# ----------------------------------------------------------------------------------------------- results


@dataclass
class RunResult:
    """One run of one workload on one engine configuration. Times are relative to the run's start."""

    label: str
    records: list[RequestRecord]
    iterations: list[dict]  # IterationRecord fields, start_time relative to the run start
    num_preemptions: int
    wall_time: float  # seconds of real time the run took (the virtual span differs under the simulator)
    stopped_early: bool = False  # the early-stop condition fired; the remaining requests were aborted
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    pipeline: dict | None = None  # engine.pipeline_stats() of the run (bubble fraction) under pipeline parallelism
    first_completion: str | None = None  # the text of request 0's output, when the engine detokenizes
    prefix_cache: dict | None = None  # this run's prefix-cache "queries" and "hits" (tokens), when the engine counts them


@dataclass
class RunState:
    """What the early-stop callback sees: the latest output of every request that produced one."""

    now: float  # relative to the run start
    num_added: int
    latest: dict  # request_id -> RequestOutput


def sampling_params_for(output_len: int, temperature: float = 0.0, stop_at_eos: bool = False) -> SamplingParams:
    """The trace's output length exactly (EOS ignored), or at most that with `stop_at_eos` (real text prompts)."""
    return SamplingParams(temperature=temperature, ignore_eos=not stop_at_eos, max_tokens=int(output_len))


def workload_requests(
    workload: Workload, prompts: Sequence[Sequence[int]], temperature: float = 0.0, stop_at_eos: bool = False
) -> list[tuple[float, list[int], SamplingParams]]:
    """Request i of `workload` as (arrival, seconds after the run start; prompt token ids; sampling params):
    what `run_workload` adds to an engine and `server.loadgen` sends to a server."""
    if len(prompts) != len(workload):
        raise ValueError(f"{len(prompts)} prompts for {len(workload)} requests")
    return [
        (float(workload.arrivals[i]), list(prompts[i]),
         sampling_params_for(workload.output_lens[i], temperature, stop_at_eos))
        for i in range(len(workload))
    ]


def workload_record(workload: Workload, i: int, request_id: str) -> RequestRecord:
    """The record of request i of `workload` before anything happened to it: id, scheduled arrival (seconds
    after the run start), prompt length and max_tokens. The caller fills in what happened."""
    return RequestRecord(
        request_id=request_id,
        arrival_time=float(workload.arrivals[i]),
        prompt_len=int(workload.prompt_lens[i]),
        max_tokens=int(workload.output_lens[i]),
    )


def _iteration_dict(it: Any, t0: float) -> dict:
    d = {name: getattr(it, name) for name in (
        "iteration", "start_time", "duration", "num_prefill_tokens", "num_decode_tokens", "num_seqs",
        "chunk_sizes", "num_preemptions", "num_padded_tokens",
    )}
    d["start_time"] = d["start_time"] - t0
    d["chunk_sizes"] = list(d["chunk_sizes"])
    return d


def _stat(engine: Any, key: str) -> int | None:
    """A cumulative counter of `engine.stats()`, or None when the engine has none."""
    try:
        return int(engine.stats()[key])
    except Exception:  # noqa: BLE001 - stats() is optional for fakes
        return None


def run_workload(
    engine: Any,
    workload: Workload,
    prompts: Sequence[list[int]],
    *,
    label: str = "run",
    id_prefix: str = "",
    temperature: float = 0.0,
    stop_at_eos: bool = False,
    progress: bool = False,
    early_stop: Callable[[RunState], bool] | None = None,
    early_stop_every: int = 8,
    clock: RealClock | VirtualClock | None = None,
    max_idle_steps: int = 10000,
) -> RunResult:
    """Run `workload` (with these prompt token ids) on `engine` until every request has finished.

    `early_stop(state)` is checked every `early_stop_every` steps; when it returns True the requests still
    in the engine are aborted, those not yet added are recorded as never run, and the run ends.
    Request ids are `f"{id_prefix}{index}"`: use a fresh prefix when reusing an engine. `stop_at_eos`: requests
    end at EOS (real text prompts) instead of running to their trace output length.
    """
    n = len(workload)
    requests = workload_requests(workload, prompts, temperature, stop_at_eos)
    clock = clock or clock_for(engine)
    arrivals = workload.arrivals
    if n and np.any(np.diff(arrivals) < 0):
        raise ValueError("workload arrivals must be non-decreasing")
    ids = [f"{id_prefix}{i}" for i in range(n)]
    log = getattr(engine, "iteration_log", [])
    log_start = len(log)
    preempt_start = _stat(engine, "num_preemptions")
    if hasattr(engine, "reset_pipeline_stats"):
        engine.reset_pipeline_stats()  # count bubbles of this run only, not warm-up or earlier runs
    if hasattr(engine, "reset_prefix_cache"):
        engine.reset_prefix_cache()  # every run (and capacity probe) starts cold: no hits on earlier runs' prompts
    prefix_start = {k: _stat(engine, f"prefix_cache_{k}") for k in ("queries", "hits")}
    latest: dict[str, Any] = {}
    finished: dict[str, Any] = {}
    add_errors: dict[str, str] = {}

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc=label, unit="req", leave=False, file=sys.stderr, dynamic_ncols=True)

    wall0 = time.monotonic()
    t0 = clock.now()
    i = 0
    steps = 0
    idle_steps = 0
    stopped = False
    while i < n or engine.has_unfinished_requests():
        now = clock.now()
        if i < n and not engine.has_unfinished_requests() and t0 + arrivals[i] > now:
            clock.wait_until(t0 + arrivals[i])
            now = clock.now()
            if clock.virtual and t0 + arrivals[i] > now:
                now = t0 + arrivals[i]  # a virtual clock that cannot be advanced: hand the request over early
        while i < n and t0 + arrivals[i] <= now:
            arrival, prompt, params = requests[i]
            try:
                engine.add_request(ids[i], prompt, params, arrival_time=t0 + arrival)
            except ValueError as e:
                add_errors[ids[i]] = str(e)
                if bar is not None:
                    bar.update(1)
            i += 1
        if not engine.has_unfinished_requests():
            continue
        log_len = len(log)
        outs = engine.step()
        if outs or len(log) != log_len:
            idle_steps = 0
        else:
            idle_steps += 1
            if idle_steps > max_idle_steps:
                raise RuntimeError(f"{label}: the engine made no progress in {max_idle_steps} consecutive steps")
        for out in outs:
            latest[out.request_id] = out
            if out.finished and out.request_id not in finished:
                finished[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        steps += 1
        if early_stop is not None and not stopped and steps % early_stop_every == 0:
            if early_stop(RunState(now=clock.now() - t0, num_added=i, latest=latest)):
                stopped = True
                for rid in ids[:i]:
                    if rid not in finished and rid not in add_errors:
                        engine.abort(rid)
                i = n  # the rest are never added
    if bar is not None:
        bar.close()
    wall = time.monotonic() - wall0

    records = []
    for k, rid in enumerate(ids):
        rec = workload_record(workload, k, rid)
        if rid in add_errors:
            rec.finish_reason, rec.error = "error", add_errors[rid]
        out = finished.get(rid) or latest.get(rid)
        if out is not None:
            m = out.metrics
            rel = lambda t: None if t is None else t - t0  # noqa: E731
            rec.arrival_time = m.arrival_time - t0
            rec.first_scheduled_time = rel(m.first_scheduled_time)
            rec.first_token_time = rel(m.first_token_time)
            rec.token_times = [t - t0 for t in m.token_times]
            rec.finished_time = rel(m.finished_time)
            rec.num_preemptions = m.num_preemptions
            rec.num_output_tokens = len(out.token_ids)
            rec.finish_reason = out.finish_reason if out.finished else None
            rec.error = out.error
        records.append(rec)
    iterations = [_iteration_dict(it, t0) for it in list(getattr(engine, "iteration_log", []))[log_start:]]
    preempt_end = _stat(engine, "num_preemptions")
    prefix_cache = None
    if None not in prefix_start.values():
        prefix_cache = {k: _stat(engine, f"prefix_cache_{k}") - v for k, v in prefix_start.items()}
    if preempt_start is not None and preempt_end is not None:
        num_preemptions = preempt_end - preempt_start
    else:
        num_preemptions = sum(r.num_preemptions for r in records)
    return RunResult(
        label=label,
        records=records,
        iterations=iterations,
        num_preemptions=num_preemptions,
        wall_time=wall,
        stopped_early=stopped,
        pipeline=engine.pipeline_stats() if hasattr(engine, "pipeline_stats") else None,
        prefix_cache=prefix_cache,
        first_completion=(getattr(finished.get(ids[0]), "text", "") or None) if ids else None,
    )


def measure_decode_iteration_time(
    engine: Any,
    *,
    batch_size: int = 8,
    prompt_len: int = 32,
    output_len: int = 32,
    vocab_size: int | None = None,
    seed: int = 0,
    id_prefix: str = "decode-probe-",
) -> float:
    """Median duration of the decode-only iterations of `batch_size` requests run together (offline).

    The reference for TBT SLOs given as a multiple (the paper's 5x strict, 25x relaxed).
    """
    from sarathi_jax.bench.metrics import decode_only_iteration_time

    max_len = int(getattr(engine, "max_model_len", prompt_len + output_len))
    p = max(1, min(prompt_len, max_len // 2))
    o = max(2, min(output_len, max_len - p))
    wl = Workload(np.zeros(batch_size), np.full(batch_size, p), np.full(batch_size, o))
    vocab = vocab_size or engine_vocab_size(engine)
    result = run_workload(engine, wl, wl.prompts(vocab, seed), id_prefix=id_prefix, label="decode probe")
    t = decode_only_iteration_time(result.iterations)
    if t is None:
        raise RuntimeError("the decode-only probe ran no decode-only iterations; cannot measure the TBT reference")
    return t


def engine_vocab_size(engine: Any, default: int = LLAMA2_VOCAB_SIZE) -> int:
    mc = getattr(engine, "model_config", None)
    return int(getattr(mc, "vocab_size", default) or default)
