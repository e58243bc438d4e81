"""Automatic prefix caching end to end: tokens are exactly those without it (greedy: HF's `generate`, the
oracle; seeded samples: the same engine with caching off), for ragged batches whose prompts share prefixes
ending exactly on a block boundary, one token past it, and covering the whole prompt; under preemption
while prefix blocks are shared, aborts, and pipeline parallelism."""

from __future__ import annotations

import numpy as np
import pytest

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from tests.sarathi_jax.engine_helpers import hf_generate

BLOCK = 16
MAX_TOKENS = 8


def shared_prefix_prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    r = lambda n: rng.integers(3, 256, size=n).tolist()  # noqa: E731
    system = r(50)
    return [
        system,  # the first wave: caches blocks 0..2 of `system`
        system,  # whole prompt cached: recomputes from the last full block that leaves its last token
        system[:48],  # exactly three cached blocks: recomputes the third (its last token)
        system[:32] + r(20),  # shares exactly two blocks
        system[:33] + r(9),  # one token past the boundary: two blocks shared, the third diverges later
        system[:17],  # one block + 1 token
        r(30),  # unrelated
        system[:5] + r(70),  # shares less than a block: nothing
    ]


@pytest.fixture(scope="module")
def case(hf_checkpoint) -> tuple:
    """(tiny Llama folder, the prompts, HF's greedy continuations of them)."""
    model_dir, prompts = hf_checkpoint("llama"), shared_prefix_prompts()
    return model_dir, prompts, hf_generate(model_dir, prompts, MAX_TOKENS)


def make_engine(model_dir, **overrides) -> LLMEngine:
    fields = dict(model=str(model_dir), token_budget=64, max_num_seqs=8, block_size=BLOCK, num_blocks=64,
                  max_model_len=256)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields), warmup=False)


def run(engine: LLMEngine, prompts, params_for, tag: str, aborts: dict[int, str] | None = None) -> dict[int, list[int]]:
    """The first prompt runs to completion first (so its blocks are cached), then the rest arrive one per
    step. `aborts`: step -> request index to abort after that step."""
    finished: dict[int, list[int]] = {}

    def drain(pending: list[int], aborts: dict[int, int]) -> None:
        step = 0
        while pending or engine.has_unfinished_requests():
            if pending:
                i = pending.pop(0)
                engine.add_request(f"{tag}{i}", prompts[i], params_for(i))
            for out in engine.step():
                if out.finished and out.finish_reason != "abort":
                    finished[int(out.request_id[len(tag):])] = list(out.token_ids)
            if step in aborts:
                engine.abort(f"{tag}{aborts[step]}")
            step += 1
            assert step < 5000

    drain([0], {})
    drain(list(range(1, len(prompts))), aborts or {})
    return finished


def greedy(i: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)


def hit_tokens(engine: LLMEngine) -> int:
    return engine.stats()["prefix_cache_hits"]


@pytest.mark.parametrize("token_budget", [16, 256])
def test_greedy_and_seeded_samples_are_exact_with_prefix_caching(case, token_budget):
    llama_dir, prompts, hf_greedy = case
    on = make_engine(llama_dir, token_budget=token_budget)
    assert on.config.enable_prefix_caching  # the default
    got = run(on, prompts, greedy, "g")
    assert [got[i] for i in range(len(prompts))] == hf_greedy
    # hits: 48 + 32 + 32 + 32 + 16 (the whole-prompt, boundary, past-boundary and one-block cases)
    assert hit_tokens(on) == 160
    on.reset_prefix_cache()
    sampled_on = run(on, prompts, seeded, "s")
    assert hit_tokens(on) == 2 * 160

    off = make_engine(llama_dir, token_budget=token_budget, enable_prefix_caching=False)
    assert run(off, prompts, seeded, "s") == sampled_on
    assert hit_tokens(off) == 0 and off.stats()["prefix_cache_queries"] == 0
    # Fewer prompt tokens computed with the cache.
    prefill = lambda e: sum(r.num_prefill_tokens for r in e.iteration_log)  # noqa: E731
    assert prefill(on) < 2 * prefill(off) - 2 * 150


def test_preemption_and_aborts_while_prefix_blocks_are_shared(case):
    llama_dir, prompts, _ = case
    # 12 blocks for 8 requests of up to 75 + 40 tokens: decodes outgrow memory and preempt later arrivals,
    # whose blocks are partly shared with running requests and come back from the cache when they resume.
    expected = hf_generate(llama_dir, prompts, 40)
    engine = make_engine(llama_dir, num_blocks=12, token_budget=32)
    got = run(engine, prompts, lambda i: greedy(i, 40), "p", aborts={3: 3})
    assert engine.scheduler.num_preemptions > 0 and hit_tokens(engine) > 0
    for i, tokens in enumerate(expected):
        if i != 3:  # aborted
            assert got[i] == tokens, f"prompt {i} diverged"
    engine.block_manager.check_invariants([])
    assert engine.stats()["num_free_blocks"] == 12


def test_pipeline_parallel_with_prefix_caching(case):
    llama_dir, prompts, hf_greedy = case
    engine = make_engine(llama_dir, pipeline_parallel_size=2)
    got = run(engine, prompts, greedy, "pp")
    assert [got[i] for i in range(len(prompts))] == hf_greedy and hit_tokens(engine) == 160
