"""`benchmarks.probes.step_replay`: shadowed replays of captured steps leave a live engine intact."""

from __future__ import annotations

import numpy as np

from benchmarks.probes.step_replay import ShadowReplayer, StepRecorder


def _cache_copy(runner) -> list[np.ndarray]:
    return [np.array(page, copy=True) for kv in runner.kv_caches for page in kv]


def test_shadow_replay_leaves_the_engine_intact():
    """Replaying overlapped decode steps (their input tokens pending on the device) writes only the scratch
    blocks and restores the runner's previous sampled tokens."""
    from sarathi_jax import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny-llama", token_budget=16, max_num_seqs=4, num_blocks=64,
                                    max_model_len=128, async_scheduling=True), warmup=False)
    recorder = StepRecorder(engine.runner, keep=3)
    replayer = ShadowReplayer(engine, num_tokens=16)
    rng = np.random.default_rng(0)
    for i in range(2):
        engine.add_request(f"r{i}", rng.integers(3, 1000, size=12).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(6):
        engine.step()
    steps = recorder.snapshot()
    assert len(steps) == 3 and all(s.num_decodes == 2 and s.prefill_tokens == 0 for s in steps)
    assert engine.core.num_in_flight == 1
    prev_tokens = engine.runner._prev_tokens
    before = _cache_copy(engine.runner)
    assert replayer.replay(steps, 4) > 0
    after = _cache_copy(engine.runner)
    assert engine.runner._prev_tokens is prev_tokens
    scratch = sorted({int(s) // 16 for s in replayer.slots})
    live = np.setdiff1d(np.arange(64), scratch)
    for b, a in zip(before, after):  # [layers, blocks, block_size, kv_heads, head_dim]
        np.testing.assert_array_equal(a[:, live], b[:, live])
    assert any(np.any(a[:, scratch] != b[:, scratch]) for b, a in zip(before, after))
    assert all(a is b for a, b in zip(recorder.snapshot(), steps))  # the replays are not recorded as steps
    engine.step()  # the engine goes on
