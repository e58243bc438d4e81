"""Speculative decoding with a separate draft model (speculative_config {"model": ...}, sarathi_jax/draft_runner.py)
on tiny random Llamas: with the target itself as its draft every proposal is the target's own continuation
(so the draft's shadowed KV cache holds every token the target's does), with a different 4-layer draft the
proposals are HF's greedy tokens of that draft; the target's tokens equal HF `generate`'s and the plain
engine's through chunked prefills, mixed batches, both loops, preemption and prefix-cache hits; seeded sampled
requests keep their tokens; no KV block leaks; nothing compiles after warm-up; a draft with another vocabulary
is refused."""

from __future__ import annotations

import pytest

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from tests.sarathi_jax.engine_helpers import run_staggered
from tests.sarathi_jax.speculation_helpers import (
    GREEDY,
    MAX_TOKENS,
    assert_no_leak,
    hf_greedy,
    hf_model,
    make_engine,
    make_prompts,
    observe,
    serve,
)


def draft_spec(model, k: int = 4) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint):
    return hf_checkpoint("llama")  # the target: 2 layers


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def hf_outputs(llama_dir, prompts):
    model = hf_model(llama_dir)
    return [hf_greedy(model, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.fixture(scope="module")
def other_dir(tiny_checkpoint):
    return tiny_checkpoint()  # 4 layers, 8 heads of 16: another KV cache shape, the same 256-token vocabulary


@pytest.mark.parametrize("token_budget, async_scheduling", [(16, True), (64, False)])
def test_the_target_as_its_own_draft_proposes_its_own_tokens(llama_dir, prompts, hf_outputs, token_budget,
                                                              async_scheduling):
    engine = make_engine(llama_dir, draft_spec(llama_dir), token_budget=token_budget,
                         async_scheduling=async_scheduling)
    steps = observe(engine)
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=2)
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_outputs
    stats = engine.stats()
    # The draft's cache mirrors the target's (prompt chunks included): its proposals are the target's tokens.
    assert stats["spec_num_draft_tokens"] > 20
    assert stats["spec_num_accepted_tokens"] >= 0.97 * stats["spec_num_draft_tokens"]  # float32 near-ties aside
    if token_budget == 64:
        assert any(any(d for _, _, d, *_ in step) and any(not dec for _, _, _, dec, _ in step) for step in steps)
    assert_no_leak(engine)


def test_another_draft_proposes_its_own_greedy_tokens(llama_dir, other_dir, prompts, hf_outputs):
    engine = make_engine(llama_dir, draft_spec(other_dir, k=3), async_scheduling=False)
    steps = observe(engine)
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=2)
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_outputs
    draft = hf_model(other_dir)
    proposals = [(tokens, d) for step in steps for _, _, d, _, tokens in step if d][:40]
    assert len(proposals) > 10
    same = sum(hf_greedy(draft, tokens, len(d)) == list(d) for tokens, d in proposals)
    assert same >= 0.9 * len(proposals), (same, len(proposals))
    assert_no_leak(engine)


def test_preemption_prefix_cache_and_sampled_requests_with_a_draft_model(llama_dir, prompts, hf_outputs):
    engine = make_engine(llama_dir, draft_spec(llama_dir), num_blocks=12)  # too few blocks for all: preempts
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=1)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_num_accepted_tokens"] >= 0.97 * stats["spec_num_draft_tokens"] > 0  # recomputed K/V too
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_outputs
    assert_no_leak(engine)

    engine = make_engine(llama_dir, draft_spec(llama_dir), enable_prefix_caching=True)
    first = run_staggered(engine, prompts, GREEDY)
    drafts, accepted = engine.stats()["spec_num_draft_tokens"], engine.stats()["spec_num_accepted_tokens"]
    again = run_staggered(engine, prompts, GREEDY)  # cached blocks: the draft's K/V for them is there too
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0 and again == first
    assert [first[f"r{i}"] for i in range(len(prompts))] == hf_outputs
    assert stats["spec_num_accepted_tokens"] - accepted >= 0.97 * (stats["spec_num_draft_tokens"] - drafts)

    requests = {"sampled": (prompts[2], SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=16,
                                                       ignore_eos=True)),
                "nucleus": (prompts[3], SamplingParams(temperature=0.7, top_p=0.8, seed=4, max_tokens=16,
                                                       ignore_eos=True))}
    spec, plain = serve(make_engine(llama_dir, draft_spec(llama_dir)), requests), serve(make_engine(llama_dir, None),
                                                                                         requests)
    for rid in requests:
        assert spec[rid][-1].token_ids == plain[rid][-1].token_ids, rid
        assert spec[rid][-1].metrics.num_draft_tokens > 0


def test_no_compilation_after_warmup_with_a_draft_model(llama_dir, other_dir, prompts):
    engine = LLMEngine(EngineConfig(model=llama_dir, token_budget=64, max_num_seqs=8, num_blocks=256,
                                    max_model_len=512, speculative_config=draft_spec(other_dir),
                                    compilation_cache_dir=None), warmup=True)
    assert engine.wait_until_compiled(timeout=600)
    draft = engine.draft_runner
    built = draft.num_traces
    assert built == len(draft.buckets) + len(engine.runner.buckets)  # proposal steps, shadow steps
    compiled = engine.runner.num_compilations
    run_staggered(engine, prompts, GREEDY, arrive_every=1)
    assert engine.stats()["spec_num_draft_tokens"] > 0
    assert engine.runner.num_compilations == compiled and draft.num_traces == built


def test_a_draft_with_another_vocabulary_is_refused(llama_dir):
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens, the model 256"):
        make_engine(llama_dir, draft_spec("tiny-llama"))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model=llama_dir, speculative_config=draft_spec(llama_dir), tensor_parallel_size=2)
