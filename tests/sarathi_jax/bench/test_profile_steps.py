"""`sarathi_jax.bench.profile_steps`: the engine it asks for, the requests it adds, bringing them into steady
decode before tracing, and the real JAX profiler trace + summary of exactly `--steps` annotated steps. A fake
engine (which runs a small jitted computation per step) stands in for `LLMEngine`: a real tiny-llama run of the
CLI takes about 25 s on a small CPU host."""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

import sarathi_jax
import sarathi_jax.engine
from sarathi_jax.bench import profile_steps


class FakeEngine:
    """Admits at most 2 waiting requests per step and prefills `chunk` prompt tokens per running sequence."""

    instances: list["FakeEngine"] = []

    def __init__(self, config) -> None:
        self.config = config
        self.model_config = SimpleNamespace(vocab_size=100)
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.added: list[tuple[str, list[int], object]] = []
        self.steps = 0
        self.steps_with_unprefilled = 0
        self._work = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
        FakeEngine.instances.append(self)

    def startup_stats(self) -> dict:
        return {"fake": True}

    def add_request(self, request_id, prompt, params) -> None:
        self.added.append((request_id, prompt, params))
        self.scheduler.waiting.append(SimpleNamespace(prompt_token_ids=prompt, num_computed_tokens=0))

    def step(self) -> None:
        self.steps += 1
        for seq in self.scheduler.running:
            seq.num_computed_tokens = min(len(seq.prompt_token_ids), seq.num_computed_tokens + 8)
        for _ in range(min(2, len(self.scheduler.waiting))):
            self.scheduler.running.append(self.scheduler.waiting.pop(0))
        if any(s.num_computed_tokens < len(s.prompt_token_ids) for s in self.scheduler.running):
            self.steps_with_unprefilled += 1
        jax.block_until_ready(self._work(jnp.ones((16, 16))))


@pytest.fixture
def fake_engine(monkeypatch):
    FakeEngine.instances = []
    monkeypatch.setattr(sarathi_jax, "LLMEngine", FakeEngine)
    monkeypatch.setattr(sarathi_jax.engine, "format_startup", lambda stats: f"startup {stats}")
    return FakeEngine


def test_profiles_steady_decode_and_summarises_the_trace(fake_engine, tmp_path, capsys):
    out = tmp_path / "prof"
    assert profile_steps.main(["--batch", "5", "--context", "20", "--steps", "3", "--token-budget", "64",
                               "--dtype", "float32", "--no-async", "--out", str(out)]) == 0
    (engine,) = fake_engine.instances
    c = engine.config
    assert (c.model, c.dtype, c.token_budget, c.max_num_seqs, c.max_model_len, c.async_scheduling) == (
        "tiny-llama", "float32", 64, 7, 20 + 4 * 3 + 64, False)
    assert [rid for rid, _, _ in engine.added] == [f"r{i}" for i in range(5)]
    assert all(len(p) == 20 and all(3 <= t < 100 for t in p) for _, p, _ in engine.added)
    params = engine.added[0][2]
    assert params.temperature == 0.0 and params.ignore_eos and params.max_tokens == 3 * 3 + 16
    # Every request admitted and prefilled before the traced steps: admitted 2, 2, 1 over steps 1-3 and 8 prompt
    # tokens per step, so the last one is prefilled by step 6 (steps 1-5 left some prompt unprefilled), then 3
    # settling steps and 3 traced ones.
    assert engine.steps_with_unprefilled == 5
    assert engine.steps == 6 + 3 + 3
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
