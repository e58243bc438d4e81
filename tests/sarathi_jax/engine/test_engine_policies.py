"""Policies change timing, never outputs: every scheduler and attention backend gives the same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.scheduler import SCHEDULER_POLICIES

PROMPT_LENGTHS = (5, 40, 77, 18, 96, 3, 60, 33)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint):
    return hf_checkpoint("llama")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENGTHS]


def run(model_dir, prompts, priorities=None, **config) -> tuple[dict[str, list[int]], LLMEngine]:
    fields = dict(model=str(model_dir), token_budget=64, max_num_seqs=8, num_blocks=256, max_model_len=256)
    fields.update(config)
    engine = LLMEngine(EngineConfig(**fields), warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    finished: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:  # arrivals while others decode
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params, priority=priorities[i] if priorities else 0)
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", out.error
                finished[out.request_id] = list(out.token_ids)
        steps += 1
        assert steps < 5_000
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    return finished, engine


@pytest.fixture(scope="module")
def reference(llama_dir, prompts):
    tokens, _ = run(llama_dir, prompts, token_budget=256)
    return tokens


@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
def test_every_policy_gives_the_same_greedy_tokens(llama_dir, prompts, reference, policy):
    tokens, _ = run(llama_dir, prompts, scheduler=policy)
    assert tokens == reference


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "simple_chunking"])
def test_preemption_by_recompute_keeps_tokens(llama_dir, prompts, reference, policy):
    # 14 blocks of 16 tokens hold ~220 tokens: the 8 requests (~330 prompt tokens + 24 outputs each) cannot all
    # stay resident, so running decodes must evict later arrivals and recompute them.
    tokens, engine = run(llama_dir, prompts, scheduler=policy, num_blocks=14, watermark=0.0)
    assert engine.scheduler.num_preemptions > 0
    assert sum(r.num_preemptions for r in engine.iteration_log) == engine.scheduler.num_preemptions
    assert tokens == reference


def test_pallas_backend_matches_xla(llama_dir, prompts, reference):
    subset = prompts[:4]
    tokens, _ = run(llama_dir, subset, attention_backend="pallas")
    assert tokens == {f"r{i}": reference[f"r{i}"] for i in range(len(subset))}


PRIORITY_ORDERS = {
    "later-first": list(range(len(PROMPT_LENGTHS)))[::-1],  # every arrival outranks those before it
    "mixed": [3, -2, 0, 7, -2, 1, 0, -(2**31)],
}


@pytest.mark.parametrize("policy,order", [("sarathi", "later-first"), ("sarathi", "mixed"), ("vllm", "mixed")])
def test_priority_scheduling_keeps_tokens_under_preemption(llama_dir, prompts, reference, policy, order):
    # The cache of test_preemption_by_recompute_keeps_tokens: lower-priority requests get evicted and recomputed.
    tokens, engine = run(llama_dir, prompts, PRIORITY_ORDERS[order], scheduler=policy, num_blocks=14,
                         watermark=0.0, scheduling_policy="priority")
    assert engine.scheduler.num_preemptions > 0
    assert tokens == reference
