"""Speculative decoding with a separate draft model (speculative_config {"model": ...}, sarathi_jax/runner/draft_runner.py)
on tiny random Llamas: with the target itself as its draft every proposal is the target's own continuation
(so the draft's shadowed KV cache holds every token the target's does), with a different 4-layer draft the
proposals are HF's greedy tokens of that draft; the target's tokens equal HF `generate`'s and the plain
engine's through chunked prefills, mixed batches, both loops, preemption and prefix-cache hits; seeded sampled
requests draw drafts from the draft's q (accepted min(1, p/q)); no KV block leaks; nothing compiles after
warm-up; a draft with another vocabulary is refused; a draft's parameters and KV cache count when the KV cache
is sized from device memory. Under tensor parallelism (tp 2, and 4 with KV heads replicated) the same, with the
draft's params and KV cache sharded on the target's mesh by the target's rules (a draft whose heads do not split
is refused at start-up); pipeline parallelism is refused."""

from __future__ import annotations

import pytest

import jax

from sarathi_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.engine import llm_engine as engine_module
from sarathi_jax.runner.compile_cache import record_compiles
from sarathi_jax.config.engine_config import resolve_dtype
from sarathi_jax.engine.llm_engine import format_startup
from sarathi_jax.models import ModelConfig
from sarathi_jax.models.presets import get_preset
from sarathi_jax.parallel import per_device_bytes
from sarathi_jax.runner.sample.rejection import verify_sampled_drafts_jit
from sarathi_jax.config.sizing import activation_bytes_estimate, draft_probs_bytes, jax_mem_fraction, kv_bytes_per_block
from tests.sarathi_jax.engine_helpers import run_staggered
from tests.sarathi_jax.speculation_helpers import (
    GREEDY,
    MAX_TOKENS,
    assert_no_leak,
    assert_placed_as_the_target,
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


@pytest.mark.parametrize("token_budget, async_scheduling, tp", [(16, True, 1), (64, False, 1), (16, True, 2),
                                                                 (64, False, 4)])
def test_the_target_as_its_own_draft_proposes_its_own_tokens(llama_dir, prompts, hf_outputs, token_budget,
                                                              async_scheduling, tp):
    # tp 2 and 4 (the draft's 2 KV heads replicated on 4 devices, as the target's): its own params and KV
    # cache sharded on the target's mesh, its shadow and proposal steps run there.
    engine = make_engine(llama_dir, draft_spec(llama_dir), token_budget=token_budget,
                         async_scheduling=async_scheduling, tensor_parallel_size=tp)
    steps = observe(engine)
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=2)
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_outputs
    stats = engine.stats()
    # The draft's cache mirrors the target's (prompt chunks included): its proposals are the target's tokens.
    assert stats["spec_num_draft_tokens"] > 20
    assert stats["spec_num_accepted_tokens"] >= 0.97 * stats["spec_num_draft_tokens"]  # float32 near-ties aside
    if token_budget == 64:
        assert any(any(d for _, _, d, *_ in step) and any(not dec for _, _, _, dec, _ in step) for step in steps)
        if tp > 1:
            plain = make_engine(llama_dir, None, token_budget=token_budget, tensor_parallel_size=tp)
            assert run_staggered(plain, prompts, GREEDY, arrive_every=2) == finished
    assert_no_leak(engine)
    assert_placed_as_the_target(engine, tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_another_draft_proposes_its_own_greedy_tokens(llama_dir, other_dir, prompts, hf_outputs, tp):
    engine = make_engine(llama_dir, draft_spec(other_dir, k=3), async_scheduling=False, tensor_parallel_size=tp)
    steps = observe(engine)
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=2)
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_outputs
    draft = hf_model(other_dir)
    proposals = [(tokens, d) for step in steps for _, _, d, _, tokens in step if d][:40]
    assert len(proposals) > 10
    same = sum(hf_greedy(draft, tokens, len(d)) == list(d) for tokens, d in proposals)
    assert same >= 0.9 * len(proposals), (same, len(proposals))
    assert_no_leak(engine)


@pytest.mark.parametrize("tp", [1, 2])
def test_preemption_prefix_cache_and_sampled_requests_with_a_draft_model(llama_dir, prompts, hf_outputs, tp):
    engine = make_engine(llama_dir, draft_spec(llama_dir), num_blocks=12, tensor_parallel_size=tp)  # preempts
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=1)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_num_accepted_tokens"] >= 0.97 * stats["spec_num_draft_tokens"] > 0  # recomputed K/V too
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_outputs
    assert_no_leak(engine)

    engine = make_engine(llama_dir, draft_spec(llama_dir), enable_prefix_caching=True, tensor_parallel_size=tp)
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
    # The target as its own draft: q == p, so rejection sampling accepts (about) every draft drawn from q.
    spec = serve(make_engine(llama_dir, draft_spec(llama_dir), tensor_parallel_size=tp), requests)
    for rid in requests:
        metrics = spec[rid][-1].metrics
        assert metrics.num_accepted_tokens >= 0.9 * metrics.num_draft_tokens > 0, rid
        assert len(spec[rid][-1].token_ids) == 16


@pytest.mark.parametrize("tp", [1, 2])
def test_no_compilation_after_warmup_with_a_draft_model(llama_dir, other_dir, prompts, tp):
    engine = LLMEngine(EngineConfig(model=llama_dir, token_budget=64, max_num_seqs=8, num_blocks=256,
                                    max_model_len=512, speculative_config=draft_spec(other_dir),
                                    compilation_cache_dir=None, tensor_parallel_size=tp), warmup=True)
    assert engine.wait_until_compiled(timeout=600)
    draft = engine.draft_runner
    built = draft.num_traces
    assert built == 3 * len(draft.buckets) + len(engine.runner.buckets)  # proposals (greedy, 2 sampled), shadows
    compiled, verifiers = engine.runner.num_compilations, verify_sampled_drafts_jit._cache_size()
    with record_compiles() as serving:  # any compile at all (a sharding warm-up missed recompiles, not retraces)
        run_staggered(engine, prompts, GREEDY, arrive_every=1)
        run_staggered(engine, prompts, SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=12,
                                                      ignore_eos=True))
    assert engine.stats()["spec_num_draft_tokens"] > 0
    assert serving.executables == 0
    assert engine.runner.num_compilations == compiled and draft.num_traces == built
    assert verify_sampled_drafts_jit._cache_size() == verifiers
    assert_placed_as_the_target(engine, tp)  # 8 heads of 16, 4 KV heads: its own shapes, the target's rules


def test_a_draft_with_another_vocabulary_a_split_it_cannot_take_or_a_pipeline_is_refused(llama_dir):
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens, the model 256"):
        make_engine(llama_dir, draft_spec("tiny-llama"))
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens, the model 256"):
        make_engine(llama_dir, draft_spec("tiny-llama"), tensor_parallel_size=2)
    # The target's own rules, at start-up, before any weight of it is read: 9 heads do not split over 2 devices.
    with pytest.raises(ValueError, match="speculative_config.model 'smollm2-135m': num_attention_heads=9 is not "
                                         "divisible by tensor_parallel_size=2"):
        make_engine(llama_dir, draft_spec("smollm2-135m"), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="'draft_model' .* pipeline_parallel_size > 1: .*would stall the pipeline"):
        EngineConfig(model=llama_dir, speculative_config=draft_spec(llama_dir), pipeline_parallel_size=2)


def test_a_draft_models_memory_counts_when_the_kv_cache_is_sized(monkeypatch):
    # Pretend the device reports its memory (as test_config_defaults does): 32 MiB left for KV caches must
    # hold the target's blocks and the draft's blocks alike (the target as its own draft: twice per block).
    mc = get_preset("tiny-llama")
    per_block = kv_bytes_per_block(mc, 16, resolve_dtype("auto", jax.default_backend()))
    fraction = jax_mem_fraction() if jax.default_backend() == "gpu" else 1.0
    act = activation_bytes_estimate(EngineConfig(token_budget=64, max_model_len=128), mc)
    limit = 2 << 30
    in_use = int(0.8 * limit / fraction) - act - (32 << 20)
    stats = {"bytes_limit": limit, "bytes_in_use": in_use, "peak_bytes_in_use": in_use}
    monkeypatch.setattr(engine_module, "_memory_stats", lambda devices: [stats] * len(devices))
    llm = LLM("tiny-llama", token_budget=64, max_model_len=128, gpu_memory_utilization=0.8, warmup=False,
              speculative_config={"model": "tiny-llama", "num_speculative_tokens": 2})
    # The draft's q ([max_num_seqs, vocab] float32 per draft step, and one of zeros) is set aside first.
    q_bytes = 4 * (2 + 1) * llm.engine.config.max_num_seqs * mc.vocab_size
    assert draft_probs_bytes(llm.engine.config, mc) == q_bytes > 0
    expected = ((32 << 20) - q_bytes) // (2 * per_block)
    startup = llm.engine.startup_stats()
    assert llm.engine.block_manager.num_total_blocks == startup["num_kv_blocks"] == expected > 0
    assert startup["draft_kv_cache_bytes"] == startup["kv_cache_bytes"] == expected * per_block
    params = jax.tree.leaves(llm.engine.runner.params)
    assert startup["draft_param_bytes"] == sum(x.nbytes for x in params) > 0
    assert "draft model" in format_startup(startup)
    # Without the draft the same memory holds twice the blocks.
    plain = LLM("tiny-llama", token_budget=64, max_model_len=128, gpu_memory_utilization=0.8, warmup=False)
    assert plain.engine.block_manager.num_total_blocks == (32 << 20) // per_block


def test_each_devices_share_of_both_kv_caches_fits_its_memory_under_tensor_parallelism(monkeypatch, llama_dir,
                                                                                        other_dir):
    # The target (4 KV heads) on 4 devices holds 1/4 of its cache per device, the draft (2 KV heads, each
    # replicated on 2 devices) 1/2 of its own: each device's 32 MiB must hold both shares, not the target's
    # budget split by the two caches' logical sizes (that gave each device 40 MiB of KV cache).
    config = EngineConfig(model=str(other_dir), token_budget=64, max_model_len=128, gpu_memory_utilization=0.8,
                          tensor_parallel_size=4, speculative_config=draft_spec(llama_dir, k=2),
                          compilation_cache_dir=None)
    act = activation_bytes_estimate(config, ModelConfig.from_pretrained(other_dir))  # with the draft's q
    limit, fraction = 2 << 30, jax_mem_fraction() if jax.default_backend() == "gpu" else 1.0
    in_use = int(0.8 * limit / fraction) - act - (32 << 20)
    stats = {"bytes_limit": limit, "bytes_in_use": in_use, "peak_bytes_in_use": in_use}
    monkeypatch.setattr(engine_module, "_memory_stats", lambda devices: [stats] * len(devices))
    engine = LLMEngine(config, warmup=False)
    used = per_device_bytes((engine.runner.kv_caches, engine.draft_runner.stage.kv_cache))
    assert len(used) == 4 and len(set(used.values())) == 1
    per_block = used[engine.devices[0]] / engine.block_manager.num_total_blocks
    assert (32 << 20) - per_block < used[engine.devices[0]] <= 32 << 20


def test_a_draft_model_is_loaded_before_the_memory_is_read(monkeypatch):
    # Its parameters then count in the devices' bytes in use, which the KV budget subtracts.
    events = []
    real_load = engine_module.load_model
    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: events.append("load") or real_load(*a, **k))
    monkeypatch.setattr(engine_module, "_memory_stats",
                        lambda devices: events.append("memory") or [None] * len(devices))
    LLM("tiny-llama", token_budget=64, max_model_len=128, warmup=False,
        speculative_config={"model": "tiny-llama", "num_speculative_tokens": 2})
    assert events[:3] == ["load", "load", "memory"]
