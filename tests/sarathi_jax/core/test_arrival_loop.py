"""`sarathi_jax.core.arrival_loop.drive` on the simulator (the real engine core on a virtual clock): arrivals join
at their times on the engine's clock, idle time jumps to the next arrival, refusals are recorded or raised,
early stop aborts what is in the engine and adds nothing more, and a stuck engine is reported."""

from __future__ import annotations

import pytest

from sarathi_jax.core.admission import AdmissionError
from sarathi_jax.core.arrival_loop import Arrival, RunState, drive
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerConfig
from sarathi_jax.sim.simulator import CostModel, SimulatedEngine

STEP_S = 0.5  # every iteration takes half a virtual second (CostModel with only an overhead)


def _engine(start: float = 10.0) -> SimulatedEngine:
    engine = SimulatedEngine(SchedulerConfig(policy="sarathi", token_budget=512, max_num_seqs=8, max_model_len=256),
                             num_blocks=128, block_size=16,
                             cost_model=CostModel(overhead_s=STEP_S, prefill_token_s=0.0, decode_token_s=0.0,
                                                  attention_s=0.0))
    engine.clock.wait_until(start)
    return engine


def _arrival(rid: str, offset: float, max_tokens: int = 2) -> Arrival:
    return Arrival(rid, offset, [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_requests_join_at_their_times_and_idle_time_jumps_to_the_next_arrival():
    engine = _engine(start=10.0)
    done: list[str] = []
    result = drive(engine, [_arrival("a", 0.0), _arrival("b", 0.2), _arrival("c", 5.0)], on_done=done.append)
    assert result.start == 10.0 and done == ["a", "b", "c"] and not result.refused
    a, b, c = (result.finished[r].metrics for r in "abc")
    assert (a.arrival_time, b.arrival_time, c.arrival_time) == (10.0, 10.2, 15.0)
    # a runs alone from 10.0; b, arriving mid-iteration, joins when it ends (10.5); a finishes at 11.0, b at
    # 11.5; the engine is then idle until c arrives at 15.0, and c takes two iterations.
    assert (a.first_scheduled_time, b.first_scheduled_time) == (10.0, 10.5)
    assert (a.finished_time, b.finished_time, c.first_scheduled_time, c.finished_time) == (11.0, 11.5, 15.0, 16.0)
    assert result.num_steps == len(engine.iteration_log) == 5 and engine.clock.now() == 16.0


def test_a_refused_request_is_recorded_or_raised():
    big = Arrival("big", 0.0, list(range(1, 300)), SamplingParams(max_tokens=2))  # longer than max_model_len
    result = drive(_engine(), [big, _arrival("ok", 0.0)])
    assert "prompt" in result.refused["big"] and list(result.finished) == ["ok"]
    with pytest.raises(AdmissionError):
        drive(_engine(), [big, _arrival("ok2", 0.0)], raise_refused=True)


def test_early_stop_aborts_the_requests_in_the_engine_and_adds_no_more():
    seen: list[RunState] = []

    def stop(state: RunState) -> bool:
        seen.append(state)
        return True

    engine = _engine()
    arrivals = [_arrival("a", 0.0, max_tokens=50), _arrival("b", 0.0, max_tokens=50), _arrival("late", 100.0)]
    result = drive(engine, arrivals, early_stop=stop, early_stop_every=2)
    assert result.stopped_early and len(seen) == 1 and seen[0].num_added == 2 and seen[0].now == 2 * STEP_S
    assert {r: o.finish_reason for r, o in result.finished.items()} == {"a": "abort", "b": "abort"}
    assert "late" not in result.latest and not engine.has_unfinished_requests()


def test_arrivals_must_be_in_order_and_a_run_is_bounded():
    with pytest.raises(ValueError, match="non-decreasing"):
        drive(_engine(), [_arrival("a", 1.0), _arrival("b", 0.0)])
    with pytest.raises(RuntimeError, match="did not finish in 3 steps"):
        drive(_engine(), [_arrival("a", 0.0, max_tokens=10)], max_steps=3)
