"""The one driver loop: timed arrivals fed to an `Engine` on the engine's own clock until every request has
finished. The bench (`sarathi_jax.bench.driver.run_workload`) and the simulator (`simulator.simulate`) both run
it; a real engine and a simulated one differ only in their clock (`engine_api.Clock`).

A request is added once its arrival time has passed on the engine's clock, with `arrival_time = run start + its
offset`, so time spent waiting for an engine step in progress counts towards its latency (as for requests
reaching a server mid-step); requests arriving during an iteration join when it ends. While the engine is idle
the loop waits on the clock until the next arrival: a wall clock sleeps, a virtual clock jumps there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sarathi_jax.core.admission import Prompt
from sarathi_jax.core.engine_api import Engine
from sarathi_jax.request.outputs import RequestOutput
from sarathi_jax.request.sampling_params import SamplingParams


@dataclass(frozen=True)
class Arrival:
    """A request the loop adds `offset` seconds after the run's start."""

    request_id: str
    offset: float
    prompt: Prompt
    params: SamplingParams
    priority: int = 0  # lower is served first under scheduling_policy="priority"
    slo_ttft_s: float | None = None  # the request's own SLO targets (outputs.RequestMetrics)
    slo_tbt_s: float | None = None


@dataclass
class RunState:
    """What the early-stop check sees: the latest output of every request that produced one."""

    now: float  # seconds since the run's start
    num_added: int
    latest: dict[str, RequestOutput]


@dataclass
class LoopResult:
    """What happened to the arrivals: times in the outputs are on the engine's clock (`start` is the run's)."""

    start: float
    latest: dict[str, RequestOutput] = field(default_factory=dict)  # each request's latest output
    finished: dict[str, RequestOutput] = field(default_factory=dict)  # each finished request's final output
    refused: dict[str, str] = field(default_factory=dict)  # request id -> why admission refused it
    num_steps: int = 0
    stopped_early: bool = False  # `early_stop` fired: the requests in the engine were aborted, the rest never added


def drive(
    engine: Engine,
    arrivals: Sequence[Arrival],
    *,
    raise_refused: bool = False,
    on_done: Callable[[str], None] | None = None,
    early_stop: Callable[[RunState], bool] | None = None,
    early_stop_every: int = 8,
    max_steps: int | None = None,
    max_idle_steps: int = 10_000,
) -> LoopResult:
    """Add `arrivals` (offsets non-decreasing) at their times and step `engine` until every request is done.

    A request admission refuses is recorded in `refused` (or, with `raise_refused`, its AdmissionError is
    raised). `on_done(request_id)` runs once a request finishes or is refused. `early_stop(state)` is checked
    every `early_stop_every` steps; when it returns True the requests still in the engine are aborted and those
    not yet added never are. RuntimeError after `max_steps` steps, or `max_idle_steps` consecutive steps that
    neither ran an iteration nor produced an output.
    """
    offsets = [a.offset for a in arrivals]
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError("arrival offsets must be non-decreasing")
    clock, log, n = engine.clock, engine.iteration_log, len(arrivals)
    result = LoopResult(start=clock.now())
    t0 = result.start
    i = idle_steps = 0
    while i < n or engine.has_unfinished_requests():
        now = clock.now()
        if i < n and not engine.has_unfinished_requests() and t0 + offsets[i] > now:
            clock.wait_until(t0 + offsets[i])
            now = clock.now()
        while i < n and t0 + offsets[i] <= now:
            a = arrivals[i]
            try:
                engine.add_request(a.request_id, a.prompt, a.params, arrival_time=t0 + a.offset,
                                   priority=a.priority, slo_ttft_s=a.slo_ttft_s, slo_tbt_s=a.slo_tbt_s)
            except ValueError as e:
                if raise_refused:
                    raise
                result.refused[a.request_id] = str(e)
                if on_done is not None:
                    on_done(a.request_id)
            i += 1
        if not engine.has_unfinished_requests():
            continue
        log_len = len(log)
        outputs = engine.step()
        result.num_steps += 1
        if max_steps is not None and result.num_steps > max_steps:
            raise RuntimeError(f"the requests did not finish in {max_steps} steps: {engine.stats()}")
        idle_steps = 0 if outputs or len(log) != log_len else idle_steps + 1
        if idle_steps > max_idle_steps:
            raise RuntimeError(f"the engine made no progress in {max_idle_steps} consecutive steps: {engine.stats()}")
        for out in outputs:
            result.latest[out.request_id] = out
            if out.finished and out.request_id not in result.finished:
                result.finished[out.request_id] = out
                if on_done is not None:
                    on_done(out.request_id)
        if early_stop is not None and not result.stopped_early and result.num_steps % early_stop_every == 0:
            if early_stop(RunState(now=clock.now() - t0, num_added=i, latest=result.latest)):
                result.stopped_early = True
                for a in arrivals[:i]:
                    if a.request_id not in result.finished and a.request_id not in result.refused:
                        engine.abort(a.request_id)
                i = n  # the rest are never added
    return result
