"""End-to-end engine tests against HF transformers (the oracle) on a tiny random Llama checkpoint."""

from __future__ import annotations

import gc
import weakref

import jax
import numpy as np
import pytest
import torch

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.engine.llm_engine import format_startup
from sarathi_jax.runner.precompile import BackgroundBuild
from sarathi_jax.runner.sample.sampler import FULL_VARIANT, SAMPLER_VARIANTS
from sarathi_jax.config.sizing import platform_buckets
from tests.sarathi_jax.engine_helpers import run_staggered

PROMPT_LENGTHS = (1, 7, 16, 33, 64, 129, 200, 300)  # ragged, crossing block and budget boundaries
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint):
    return hf_checkpoint("llama")


@pytest.fixture(scope="module")
def prompts(llama_dir):
    from sarathi_jax.models import ModelConfig

    vocab = ModelConfig.from_pretrained(llama_dir).vocab_size
    rng = np.random.default_rng(1234)
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_greedy(llama_dir, prompts):
    """HF `generate` greedy continuations, one prompt at a time (no padding), EOS disabled."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32).eval()
    config = GenerationConfig(
        max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None
    )
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, generation_config=config, attention_mask=torch.ones_like(ids))
            outs.append(generated[0, len(prompt) :].tolist())
    return outs


def make_engine(model_dir, **overrides) -> LLMEngine:
    """A small engine that compiles buckets lazily (warm-up is tested on its own)."""
    fields = dict(model=model_dir, token_budget=64, max_num_seqs=8, block_size=16, num_blocks=256, max_model_len=512)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields), warmup=False)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("token_budget", [16, 64, 256])
def test_greedy_matches_hf_generate(llama_dir, prompts, hf_greedy, token_budget, block_size):
    engine = make_engine(llama_dir, token_budget=token_budget, block_size=block_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    finished = run_staggered(engine, prompts, params)
    for i, expected in enumerate(hf_greedy):
        assert finished[f"r{i}"] == expected, f"prompt {i} (length {PROMPT_LENGTHS[i]}) diverged"
    # Chunking really happened: some iteration mixed decodes with a prefill chunk.
    assert any(r.num_decode_tokens and r.num_prefill_tokens for r in engine.iteration_log)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_seeded_sampling_is_batch_independent(llama_dir, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    solo_tokens = run_staggered(make_engine(llama_dir), [prompts[3]], params)["r0"]

    busy = make_engine(llama_dir)
    other = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    for i, prompt in enumerate(prompts[:5]):
        busy.add_request(f"o{i}", prompt, other)
    busy.add_request("x", prompts[3], params)
    tokens = None
    while busy.has_unfinished_requests():
        for out in busy.step():
            if out.request_id == "x" and out.finished:
                tokens = list(out.token_ids)
    assert tokens == solo_tokens
    assert len(set(tokens)) > 1  # really sampled, not a constant


def test_no_compilation_after_warmup(llama_dir, prompts):
    engine = LLMEngine(
        EngineConfig(model=llama_dir, token_budget=64, max_num_seqs=8, num_blocks=256, max_model_len=512),
        warmup=True,
    )
    assert engine.wait_until_compiled(timeout=600)
    compiled = engine.runner.num_compilations
    runner = engine.runner
    assert runner.num_step_compilations == len(runner.buckets)
    # The LM head and sampler per row count R of the row ladder (the buckets' min(bucket, max_num_seqs)): every
    # variant for the largest bucket's 8 rows, the greedy and general ones for the 4 rows of a CPU's 4-token
    # bucket, which any step of up to 4 sequences samples (other variants fall back to FULL). Nothing else: one
    # model step per bucket.
    assert runner.row_ladder == ((4, 8) if runner.buckets[0] < 8 else (8,))
    small = {(v, 4) for v in (SAMPLER_VARIANTS[0], FULL_VARIANT)} if runner.buckets[0] < 8 else set()
    assert runner._table.variants == {(v, 8) for v in SAMPLER_VARIANTS} | small
    assert set(runner._table.executables) == runner._table.variants | {
        (0, runner._layout(bucket).batch_len) for bucket in runner.buckets}
    run_staggered(engine, prompts[:6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    run_staggered(engine, prompts[:2], SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=4, ignore_eos=True))
    assert engine.runner.num_compilations == compiled


def test_background_compile_gives_the_same_tokens_before_and_after_the_buckets_are_built(
        llama_dir, prompts, hf_greedy, monkeypatch):
    # Hold the background build: the engine then has only the largest bucket and the general sampler (no
    # compilation cache, whose ready-made executables would load before the engine is ready).
    start = BackgroundBuild.start
    monkeypatch.setattr(BackgroundBuild, "start", lambda self: self)
    engine = LLMEngine(EngineConfig(model=llama_dir, token_budget=64, max_num_seqs=8, num_blocks=256,
                                    max_model_len=512, compilation_cache_dir=None))
    runner, top = engine.runner, engine.runner.buckets[-1]
    assert runner.ready_buckets == (top,) and len(runner.buckets) > 1
    assert engine.startup_stats()["background_executables"] == len(runner.buckets) - 1 + len(SAMPLER_VARIANTS) - 1
    assert engine.startup_stats()["background_compile_s"] is None
    assert "more building in the background" in format_startup(engine.startup_stats())
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)

    def serve() -> tuple[dict, dict]:
        tokens: dict = {}
        logprobs: dict = {f"g{i}": [] for i in range(5)}
        for i, prompt in enumerate(prompts[:5]):
            engine.add_request(f"g{i}", prompt, greedy)
            engine.add_request(f"s{i}", prompt, sampled)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = list(out.token_ids)
                logprobs.get(out.request_id, []).extend(out.new_logprobs)
        return tokens, logprobs

    held_tokens, held_logprobs = serve()
    assert {r.num_padded_tokens for r in engine.iteration_log} == {top}
    start(runner.background)
    assert engine.wait_until_compiled(timeout=600) and runner.ready_buckets == runner.buckets
    assert engine.startup_stats()["background_compile_s"] > 0
    assert "more built in the background in" in format_startup(engine.startup_stats())
    compiled = runner.num_compilations
    assert runner.num_step_compilations == len(runner.buckets)
    log_start = len(engine.iteration_log)
    built_tokens, built_logprobs = serve()
    assert runner.num_compilations == compiled  # serving compiled nothing
    assert min(r.num_padded_tokens for r in engine.iteration_log[log_start:]) < top  # smaller buckets ran
    assert built_tokens == held_tokens
    assert [held_tokens[f"g{i}"] for i in range(5)] == hf_greedy[:5]
    for rid, held in held_logprobs.items():  # the general sampler stood in for the greedy-with-logprobs one
        assert len(held) == MAX_TOKENS
        for step_held, step_built in zip(held, built_logprobs[rid], strict=True):
            assert (step_held.token_id, step_held.top_token_ids) == (step_built.token_id, step_built.top_token_ids)
            np.testing.assert_allclose((step_held.logprob, *step_held.top_logprobs),
                                       (step_built.logprob, *step_built.top_logprobs), rtol=0, atol=1e-5)


def test_dropping_an_engine_stops_its_background_build(llama_dir):
    engine = LLMEngine(EngineConfig(model=llama_dir, token_budget=64, max_num_seqs=8, num_blocks=64,
                                    max_model_len=256, compilation_cache_dir=None))
    background, runner = engine.runner.background, weakref.ref(engine.runner)
    assert background is not None and not background.cancelled
    del engine
    gc.collect()
    assert runner() is None, "the background build keeps the runner alive"
    assert background.cancelled and background.wait(timeout=120)


def test_abort_frees_every_block(llama_dir, prompts):
    engine = make_engine(llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_total_blocks
    aborted = {"r0", "r5", "r7"}
    for rid in aborted:
        assert engine.abort(rid)
    assert not engine.abort("no-such-request")
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert {rid for rid, r in reasons.items() if r == "abort"} == aborted
    assert all(reasons[f"r{i}"] == "length" for i in range(len(prompts)) if f"r{i}" not in aborted)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt"),
        ([10**9], SamplingParams(), "prompt"),
        ([-1, 2], SamplingParams(), "prompt"),
        (list(range(2, 600)), SamplingParams(), "prompt"),  # longer than max_model_len=512
        ([1, 2, 3], SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
    ],
)
def test_bad_request_gets_value_error_and_others_complete(llama_dir, prompts, prompt, params, field):
    engine = make_engine(llama_dir)
    good = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("before", prompts[1], good)
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)
    engine.add_request("after", prompts[2], good)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"before", "after"}
    assert all(len(o.token_ids) == 4 for o in done.values())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.5), "temperature"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _profile(tmp_path) -> str:
    """A saved cost model with a known answer: 10 ms + 0.1 ms per token of the bucket."""
    from sarathi_jax.sim.cost_model import BucketCostModel

    path = tmp_path / "profile.json"
    path.write_text(__import__("json").dumps(BucketCostModel({16: 0.0116, 256: 0.0356}, 0.0, 0.0).to_dict()))
    return str(path)


@pytest.mark.parametrize("mode", ["auto", "dynamic"])
def test_greedy_matches_hf_under_slo_token_budgets(llama_dir, prompts, hf_greedy, tmp_path, mode):
    """token_budget "auto" (0.01 + 1e-4 x B <= 0.9 x 20 ms: B = 80, the top bucket of its engine) and "dynamic"
    (compiled for 256 on the fine ladder, whose 80 bucket holds B = 80: on the coarse one's 64, 96, ... it was
    64-token batches while requests decode) from a saved profile: HF's tokens either way. "dynamic" predicts
    with the buckets its runner compiled."""
    engine = make_engine(llama_dir, token_budget=mode, slo_tbt_s=0.02, max_token_budget=256,
                         cost_profile=_profile(tmp_path))
    assert engine.config.token_budget == (80 if mode == "auto" else 256)
    assert engine.startup_stats()["token_budget"]["mode"] == mode
    assert f"token budget {mode}" in format_startup(engine.startup_stats())
    if mode == "dynamic":
        assert engine.runner.buckets == platform_buckets(256, jax.default_backend(), "fine")
        assert engine.budget_setup.policy.predictor.buckets == engine.runner.buckets
        assert engine.budget_setup.policy.feedback.log is engine.iteration_log  # the slack reads the records
        # The profile's known answer alone: the slack measured on this machine would move the limit either way
        # (tests/sarathi_jax/scheduler/test_budget.py covers it).
        engine.budget_setup.policy.feedback = None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    finished = run_staggered(engine, prompts, params)
    for i, expected in enumerate(hf_greedy):
        assert finished[f"r{i}"] == expected, f"prompt {i} (length {PROMPT_LENGTHS[i]}) diverged"
    sizes = [(r.num_prefill_tokens + r.num_decode_tokens, r.num_decode_tokens) for r in engine.iteration_log]
    limit = 80
    assert max(total for total, decodes in sizes if decodes) == limit  # the target holds while requests decode
    assert any(decodes and total > decodes for total, decodes in sizes)  # chunks ran beside decodes
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_dynamic_budget_on_the_fine_ladder_never_compiles_after_warm_up(llama_dir, prompts, hf_greedy, tmp_path):
    """"dynamic"'s fine ladder (every multiple of 16 to 128, then 1.25x steps): one step executable per bucket,
    all built at warm-up; serving then compiles nothing, whatever budget each iteration picks, and gives HF's
    tokens."""
    engine = LLMEngine(EngineConfig(model=llama_dir, token_budget="dynamic", slo_tbt_s=0.02, max_token_budget=256,
                                    cost_profile=_profile(tmp_path), max_num_seqs=8, num_blocks=256,
                                    max_model_len=512), warmup=True)
    assert engine.wait_until_compiled(timeout=600)
    runner = engine.runner
    assert engine.config.bucket_ladder == "fine"
    assert runner.buckets == platform_buckets(256, jax.default_backend(), "fine") and 160 in runner.buckets
    assert runner.num_step_compilations == len(runner.buckets)
    compiled = runner.num_compilations
    finished = run_staggered(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_greedy
    assert runner.num_compilations == compiled
    ran = {runner.bucket_for(r.num_prefill_tokens + r.num_decode_tokens) for r in engine.iteration_log}
    assert {48, 80} <= ran  # buckets the coarse ladder lacks; 80: the target's, beside decodes


def test_auto_budget_calibrates_at_start_up_and_caches_the_cost_model(llama_dir, prompts, hf_greedy, tmp_path):
    """No profile: timed steps through the runner, a fitted model cached beside the compilation cache, which
    a second engine loads instead of calibrating."""
    kw = dict(token_budget="auto", slo_tbt_s=10.0, max_token_budget=64, compilation_cache_dir=str(tmp_path))
    engine = make_engine(llama_dir, **kw)
    setup = engine.startup_stats()["token_budget"]
    assert setup["cost_model_source"].startswith("calibrated at start-up, cached ")
    assert engine.config.token_budget == 64 and setup["meets"]  # 10 s: everything fits
    cached = list((tmp_path / "sarathi-cost-models").glob("*.json"))
    assert len(cached) == 1
    again = make_engine(llama_dir, **kw)
    assert again.startup_stats()["token_budget"]["cost_model_source"] == f"cached {cached[0]}"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    finished = run_staggered(again, prompts[:4], params)
    assert [finished[f"r{i}"] for i in range(4)] == hf_greedy[:4]
