"""`sarathi_jax.core.engine_api`: the wall clock waits by sleeping, and both engines offer every member of the
`Engine` protocol (LLMEngine on the wall clock, SimulatedEngine on its virtual one)."""

from __future__ import annotations

import time

from sarathi_jax.core.engine_api import Engine, WallClock
from sarathi_jax.scheduler import SchedulerConfig
from sarathi_jax.sim.simulator import SimulatedEngine, VirtualClock

MEMBERS = sorted(name for name in vars(Engine) if not name.startswith("_"))


def test_the_wall_clock_sleeps_until_the_time_asked_for():
    clock = WallClock()
    t0 = clock.now()
    assert abs(t0 - time.monotonic()) < 0.1
    clock.wait_until(t0 + 0.05)
    assert clock.now() >= t0 + 0.05
    before = time.monotonic()
    clock.wait_until(t0)  # already past: no wait
    assert time.monotonic() - before < 0.05


def test_the_virtual_clock_jumps_forward_and_never_back():
    clock = VirtualClock(3.0)
    clock.wait_until(5.5)
    clock.wait_until(4.0)
    assert clock.now() == 5.5


def test_both_engines_offer_the_whole_protocol():
    from sarathi_jax import EngineConfig, LLMEngine

    assert {"add_request", "add_admitted", "step", "abort", "clock", "iteration_log"} <= set(MEMBERS)
    simulated = SimulatedEngine(SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=4, max_model_len=128),
                                num_blocks=32)
    real = LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", token_budget=32, max_num_seqs=4,
                                  num_blocks=32, max_model_len=128), warmup=False)
    for engine in (simulated, real):
        assert [name for name in MEMBERS if not hasattr(engine, name)] == [], type(engine).__name__
    assert isinstance(real.clock, WallClock) and isinstance(simulated.clock, VirtualClock)
    assert simulated.pipeline_stats() is None and simulated.startup_stats() is None and simulated.config is None
    assert real.startup_stats()["warmed_up"] is False and real.config.model == "tiny-llama"
