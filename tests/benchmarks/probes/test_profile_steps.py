"""`benchmarks.probes.profile_steps`: the engine it asks for, the requests it adds, bringing them into steady
decode before tracing, and the real JAX profiler trace + summary of exactly `--steps` annotated steps. A fake
engine (which runs a small jitted computation per step) stands in for `LLMEngine`: a real tiny-llama run of the
CLI takes about 25 s on a small CPU host."""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import pytest

import sarathi_jax
import sarathi_jax.engine.llm_engine
from benchmarks.probes import profile_steps
from sarathi_jax.scheduler import SchedulerConfig
from sarathi_jax.sim.simulator import SimulatedEngine


class FakeEngine(SimulatedEngine):
    """The simulator (the real engine core, scheduler and block manager) built from the EngineConfig it is given,
    with a vocabulary of 100; each step also runs a small jitted computation, so that the trace has device
    work. It records, before each step, whether every request was already running with its prompt prefilled."""

    instances: list["FakeEngine"] = []

    def __init__(self, config) -> None:
        super().__init__(SchedulerConfig(policy=config.scheduler, token_budget=config.token_budget,
                                         max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len),
                         num_blocks=256, block_size=16, vocab_size=100)
        self.config = config
        self.added: list[tuple[str, list[int], object]] = []
        self.steady_before_step: list[bool] = []
        self._work = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
        FakeEngine.instances.append(self)

    def startup_stats(self) -> dict:
        return {"fake": True}

    def add_request(self, request_id, prompt, params=None, arrival_time=None, priority=0) -> None:
        self.added.append((request_id, prompt, params))
        super().add_request(request_id, prompt, params, arrival_time)

    def step(self):
        running = self.scheduler.running
        self.steady_before_step.append(len(running) == len(self.added) and not self.scheduler.waiting and all(
            s.num_computed_tokens >= len(s.prompt_token_ids) for s in running))
        outputs = super().step()
        jax.block_until_ready(self._work(jnp.ones((16, 16))))
        return outputs


@pytest.fixture
def fake_engine(monkeypatch):
    FakeEngine.instances = []
    monkeypatch.setattr(sarathi_jax, "LLMEngine", FakeEngine)
    monkeypatch.setattr(sarathi_jax.engine.llm_engine, "format_startup", lambda stats: f"startup {stats}")
    return FakeEngine


def test_profiles_steady_decode_and_summarises_the_trace(fake_engine, tmp_path, capsys):
    out = tmp_path / "prof"
    assert profile_steps.main(["--batch", "5", "--context", "20", "--steps", "3", "--token-budget", "64",
                               "--dtype", "float32", "--no-async", "--out", str(out)]) == 0
    (engine,) = fake_engine.instances
    c = engine.config
    prefill_steps = 2 + 5 + 2  # 100 prompt tokens at 64 - 5 a step, one step for each request, two spare
    assert (c.model, c.dtype, c.token_budget, c.max_num_seqs, c.max_model_len, c.async_scheduling) == (
        "tiny-llama", "float32", 64, 7, 20 + 4 * 3 + 64 + prefill_steps, False)
    assert [rid for rid, _, _ in engine.added] == [f"r{i}" for i in range(5)]
    assert all(len(p) == 20 and all(3 <= t < 100 for t in p) for _, p, _ in engine.added)
    params = engine.added[0][2]
    assert params.temperature == 0.0 and params.ignore_eos and params.max_tokens == prefill_steps + 3 * 3 + 16
    # Every request admitted and prefilled before the settling and traced steps: 100 prompt tokens under a budget
    # of 64 take two steps, after which every step starts in steady decode (3 settling steps, 3 traced ones).
    assert engine.steady_before_step == [False, False] + [True] * (3 + 3)
    assert not engine.scheduler.waiting and len(engine.scheduler.running) == 5
    text = capsys.readouterr().out
    traces = sorted(glob.glob(os.path.join(out, "**", "*perfetto_trace.json.gz"), recursive=True))
    assert traces and f"trace: {traces[-1]}" in text
    assert text.startswith("startup {'fake': True}")
    assert "3 steps: " in text  # exactly the annotated steps were found in the trace
    assert "busiest host events on the stepping thread" in text


def test_bad_arguments_exit(fake_engine):
    with pytest.raises(SystemExit):
        profile_steps.main(["--dtype", "float16"])
    assert fake_engine.instances == []


def test_requests_outlive_a_long_prefill_under_a_small_budget(fake_engine, tmp_path):
    # 8 prompts of 200 tokens under a budget of 16: about 200 steps of prefill while the first requests already
    # decode. Every request must still be running when the last prompt is in (were one to finish first, the
    # probe would spin forever waiting for the batch to fill).
    assert profile_steps.main(["--batch", "8", "--context", "200", "--steps", "2", "--token-budget", "16",
                               "--dtype", "float32", "--no-async", "--out", str(tmp_path / "prof")]) == 0
    (engine,) = fake_engine.instances
    assert engine.steady_before_step[-4:] == [True] * 4 and len(engine.scheduler.running) == 8


def test_steady_decode_says_when_a_request_finishes_first(fake_engine):
    engine = fake_engine(sarathi_jax.EngineConfig(model="tiny-llama", token_budget=16, max_num_seqs=8,
                                                  max_model_len=512))
    with pytest.raises(RuntimeError, match="finished before all 4 were decoding"):
        profile_steps.steady_decode(engine, batch=4, context=100, max_tokens=3)
