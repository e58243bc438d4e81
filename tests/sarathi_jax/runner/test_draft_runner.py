"""Self-speculative decoding (speculative_config method "self", sarathi_jax/runner/draft_runner.py) end to end on tiny
random Llamas: the drafts are the greedy tokens of HF's model cut to its first L layers (the draft's oracle);
greedy tokens equal HF `generate`'s and the same engine's without speculation through chunked prefills, mixed
batches, both loops, preemption, prefix-cache hits and max_tokens inside an accepted run; seeded sampled
requests draw drafts from the draft's q and accept min(1, p/q) of them, reproducibly; no KV block leaks; the
draft compiles per bucket at warm-up and never while serving; bad configs are refused. Under tensor parallelism
(tp 2, and 4 with KV heads replicated) the same, with the draft on the target's mesh and shardings; pipeline
parallelism is refused."""

from __future__ import annotations

import pytest

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.runner.compile_cache import record_compiles
from sarathi_jax.runner.sample.rejection import verify_sampled_drafts_jit
from tests.sarathi_jax.engine_helpers import run_staggered
from tests.sarathi_jax.speculation_helpers import (
    GREEDY,
    MAX_TOKENS,
    assert_drafts_are_the_cut_models,
    assert_placed_as_the_target,
    assert_no_leak,
    hf_greedy,
    hf_model,
    make_engine,
    make_prompts,
    observe,
    self_spec,
    serve,
    with_idle_layers,
)


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint):
    return hf_checkpoint("llama")  # 2 layers: the draft is layer 0


@pytest.fixture(scope="module")
def deep_dir(tiny_checkpoint):
    return tiny_checkpoint()  # 4 layers, untied LM head


@pytest.fixture(scope="module")
def idle_dir(llama_dir, tmp_path_factory):
    return with_idle_layers(llama_dir, tmp_path_factory.mktemp("idle-llama"), 1)  # layer 1 adds nothing


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def hf_outputs(llama_dir, prompts):
    model = hf_model(llama_dir)
    return [hf_greedy(model, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("token_budget, async_scheduling, tp", [(16, True, 1), (64, False, 1), (16, True, 2),
                                                                 (64, False, 4)])
def test_self_draft_greedy_matches_hf_and_no_speculation(llama_dir, prompts, hf_outputs, token_budget,
                                                         async_scheduling, tp):
    # tp 2 and 4 (KV heads replicated: 2 of them on 4 devices): the draft on the target's mesh and shardings.
    engine = make_engine(llama_dir, self_spec(1), token_budget=token_budget, async_scheduling=async_scheduling,
                         tensor_parallel_size=tp)
    steps = observe(engine)
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=2)
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_outputs
    stats = engine.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]  # both paths ran
    assert all(sum(n for _, n, *_ in step) <= token_budget for step in steps)
    if token_budget == 64:  # a batch mixed a speculating decode, a plain decode and a prefill chunk
        assert any(any(d for _, _, d, *_ in step) and any(dec and not d for _, _, d, dec, _ in step)
                   and any(not dec for _, _, _, dec, _ in step) for step in steps)
        plain_engine = make_engine(llama_dir, None, token_budget=token_budget, tensor_parallel_size=tp)
        assert run_staggered(plain_engine, prompts, GREEDY, arrive_every=2) == finished
    assert_drafts_are_the_cut_models(llama_dir, 1, steps)
    assert_no_leak(engine)
    assert_placed_as_the_target(engine, tp)


@pytest.mark.parametrize("num_layers, scan_layers", [(1, False), (3, True)])
def test_deeper_model_drafts_from_its_first_layers(deep_dir, prompts, num_layers, scan_layers):
    # 4 layers, untied LM head; unrolled (`layers_i` params) and scanned (stacked params sliced) forms.
    engine = make_engine(deep_dir, self_spec(num_layers, k=3), scan_layers=scan_layers)
    steps = observe(engine)
    finished = run_staggered(engine, prompts[:4], GREEDY, arrive_every=1)
    target = hf_model(deep_dir)
    assert [finished[f"r{i}"] for i in range(4)] == [hf_greedy(target, p, MAX_TOKENS) for p in prompts[:4]]
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    assert_drafts_are_the_cut_models(deep_dir, num_layers, steps)
    assert_no_leak(engine)


@pytest.mark.parametrize("tp", [1, 2])
def test_preemption_and_prefix_cache_hits_with_self_draft(llama_dir, prompts, hf_outputs, tp):
    engine = make_engine(llama_dir, self_spec(1), num_blocks=12, tensor_parallel_size=tp)  # too few: preempts
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=1)
    assert engine.stats()["num_preemptions"] > 0 and engine.stats()["spec_num_accepted_tokens"] > 0
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_outputs
    assert_no_leak(engine)

    engine = make_engine(llama_dir, self_spec(1), enable_prefix_caching=True, tensor_parallel_size=tp)
    first = run_staggered(engine, prompts, GREEDY)
    again = run_staggered(engine, prompts, GREEDY)  # the same prompts: their full blocks are cached
    assert engine.stats()["prefix_cache_hits"] > 0
    assert [first[f"r{i}"] for i in range(len(prompts))] == hf_outputs and again == first
    engine.block_manager.check_invariants([])


@pytest.mark.parametrize("tp", [1, 2])
def test_max_tokens_inside_an_accepted_run_and_sampled_requests(idle_dir, prompts, tp):
    # A target whose second layer adds nothing: the one-layer draft proposes its tokens, so runs are long and
    # max_tokens falls inside them. With tp 2 the sampled drafts' q and their verification run on the mesh.
    engine = make_engine(idle_dir, self_spec(1), tensor_parallel_size=tp)
    expected = hf_greedy(hf_model(idle_dir), prompts[4], MAX_TOKENS)
    requests = {f"m{m}": (prompts[4], GREEDY.replace(max_tokens=m)) for m in range(2, MAX_TOKENS + 1)}
    requests["sampled"] = (prompts[2], SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=16,
                                                      ignore_eos=True))
    requests["nucleus"] = (prompts[3], SamplingParams(temperature=0.7, top_p=0.8, seed=4, max_tokens=16,
                                                      ignore_eos=True))
    outs = serve(engine, requests)
    for m in range(2, MAX_TOKENS + 1):
        last = outs[f"m{m}"][-1]
        assert list(last.token_ids) == expected[:m] and last.finish_reason == "length"
    assert sum(len(outs[f"m{m}"][-1].new_token_ids) > 1 for m in range(2, MAX_TOKENS + 1)) > 5
    greedy = [outs[f"m{m}"][-1].metrics for m in range(2, MAX_TOKENS + 1)]
    assert sum(m.num_accepted_tokens for m in greedy) >= 0.95 * sum(m.num_draft_tokens for m in greedy) > 0
    # Sampled requests draw their drafts from the draft's q, which here is the target's p (its second layer
    # adds nothing): rejection sampling accepts min(1, p/q) = 1 of them (float rounding aside). (An argmax
    # proposal would accept only p(argmax) of them.) The tokens are the target's in distribution, not the
    # plain run's (they depend on the k each step grants): the same requests and seeds give the same tokens.
    again = serve(make_engine(idle_dir, self_spec(1), tensor_parallel_size=tp), requests)
    for rid in ("sampled", "nucleus"):
        metrics = outs[rid][-1].metrics
        assert metrics.num_accepted_tokens >= 0.9 * metrics.num_draft_tokens > 0, rid
        assert len(outs[rid][-1].token_ids) == 16 and again[rid][-1].token_ids == outs[rid][-1].token_ids, rid
    assert_no_leak(engine)


@pytest.mark.parametrize("tp", [1, 2])
def test_no_compilation_after_warmup_with_self_draft(llama_dir, prompts, tp):
    engine = LLMEngine(EngineConfig(model=llama_dir, token_budget=64, max_num_seqs=8, num_blocks=256,
                                    max_model_len=512, speculative_config=self_spec(1),
                                    compilation_cache_dir=None, tensor_parallel_size=tp), warmup=True)
    assert engine.wait_until_compiled(timeout=600)
    draft = engine.draft_runner
    assert draft.num_traces == 3 * len(draft.buckets)  # per bucket, at warm-up: greedy, sampled (2 filters)
    assert draft.stage is engine.runner.stages[0]  # the target's params and KV cache, where they are
    compiled, verifiers = engine.runner.num_compilations, verify_sampled_drafts_jit._cache_size()
    with record_compiles() as serving:  # any compile at all (a sharding warm-up missed recompiles, not retraces)
        run_staggered(engine, prompts, GREEDY, arrive_every=1)
        run_staggered(engine, prompts, SamplingParams(temperature=0.7, seed=1, max_tokens=12, ignore_eos=True))
        run_staggered(engine, prompts, SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=12,
                                                      ignore_eos=True))
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    assert serving.executables == 0
    assert engine.runner.num_compilations == compiled and draft.num_traces == 3 * len(draft.buckets)
    assert verify_sampled_drafts_jit._cache_size() == verifiers  # the rejection step: built at warm-up
    assert_placed_as_the_target(engine, tp)


@pytest.mark.parametrize("spec, match", [
    ({"method": "self", "num_layers": 0}, "num_layers must be a positive integer"),
    ({"method": "self"}, "needs num_layers"),
    ({"method": "self", "num_layers": 1, "draft": "x"}, "unknown keys"),
    ({"method": "ngram", "num_layers": 1}, "for method 'self' only"),
])
def test_bad_self_configs_are_refused(llama_dir, spec, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=llama_dir, speculative_config=spec)


def test_self_draft_as_deep_as_the_model_and_pipelines_are_refused(llama_dir):
    with pytest.raises(ValueError, match="less than the model's 2 layers"):
        make_engine(llama_dir, self_spec(2))
    with pytest.raises(ValueError, match="'self' .* pipeline_parallel_size > 1: .*different stages.*would stall"):
        EngineConfig(model=llama_dir, speculative_config=self_spec(1), pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        EngineConfig(model=llama_dir, speculative_config=self_spec(1), tensor_parallel_size=2,
                     pipeline_parallel_size=2)
