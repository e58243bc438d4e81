"""The engine core: the overlapped loop against the synchronous one, token by token, and one core for all.

The oracle of the synchronous loop is HF (tests/sarathi_jax/engine/test_engine.py); here the overlapped loop must
give the same outputs as the synchronous one on ragged workloads with stop strings, stop tokens, min_tokens,
logprobs, seeded sampling, aborts between dispatch and retirement, forced preemption, and PP = 2.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.core.engine_core import EngineCore
from sarathi_jax.request.outputs import TokenLogprob
from sarathi_jax.scheduler import SchedulerConfig
from sarathi_jax.sim.simulator import CostModelExecutor, SimulatedEngine

PROMPT_LENGTHS = (1, 5, 17, 33, 40, 64, 90, 120)


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint):
    return hf_checkpoint("llama")  # has a tokenizer.json: text and stop strings work


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(99)
    return [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENGTHS]


def make_engine(model_dir, async_scheduling: bool, **overrides) -> LLMEngine:
    fields = dict(model=str(model_dir), token_budget=64, max_num_seqs=8, block_size=16, num_blocks=96,
                  max_model_len=256, async_scheduling=async_scheduling)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields), warmup=False)


@dataclasses.dataclass
class Collected:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    final_token_ids: tuple[int, ...] = ()
    final_text: str = ""


def run(engine: LLMEngine, requests, aborts: dict[int, list[str]] | None = None) -> dict[str, Collected]:
    """requests: (arrival step, request id, prompt, params); aborts: step -> request ids to abort right after
    that step's `engine.step()` (so, in the overlapped loop, while a batch with them is in flight)."""
    aborts = aborts or {}
    pending = sorted(requests, key=lambda r: r[0])
    got: dict[str, Collected] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
            got[rid] = Collected()
        for out in engine.step():
            c = got[out.request_id]
            assert c.finish_reason is None, f"{out.request_id} got an output after it finished"
            c.token_ids.extend(out.new_token_ids)
            c.text += out.text_delta
            c.logprobs.extend(out.new_logprobs)
            assert tuple(c.token_ids) == out.token_ids
            if out.finished:
                c.finish_reason, c.final_token_ids, c.final_text = out.finish_reason, out.token_ids, out.text
        for rid in aborts.get(step, ()):
            engine.abort(rid)
        step += 1
        assert step < 5000
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    assert all(c.finish_reason is not None for c in got.values())
    return got


def assert_same(got: dict[str, Collected], ref: dict[str, Collected], skip: set[str] = frozenset()) -> None:
    assert got.keys() == ref.keys()
    for rid in ref:
        if rid in skip:
            continue
        g, r = got[rid], ref[rid]
        assert (g.token_ids, g.finish_reason, g.text) == (r.token_ids, r.finish_reason, r.text), rid
        assert len(g.logprobs) == len(r.logprobs), rid
        for a, b in zip(g.logprobs, r.logprobs):
            assert a.token_id == b.token_id and a.top_token_ids == b.top_token_ids, rid
            np.testing.assert_allclose(a.logprob, b.logprob, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, rtol=1e-5, atol=1e-5)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def mixed_requests(prompts, stop_token: int, stop_string: str) -> list:
    """Greedy, seeded sampled (top-k/top-p/min-p), logprobs, stop token, stop string, min_tokens."""
    kinds = [
        greedy(max_tokens=12),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True),
        greedy(max_tokens=9, logprobs=3),
        greedy(max_tokens=20, stop_token_ids=[stop_token]),
        greedy(max_tokens=20, stop=[stop_string]),
        greedy(max_tokens=14, stop_token_ids=[stop_token], min_tokens=8),
        SamplingParams(temperature=1.0, min_p=0.05, seed=11, max_tokens=7, logprobs=2, ignore_eos=True),
        greedy(max_tokens=1),
    ]
    return [(i * 2, f"r{i}", p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def stop_markers(llama_dir, prompts):
    """A stop token and a stop string that greedy decoding really produces mid-output (found by a plain run)."""
    engine = make_engine(llama_dir, async_scheduling=False)
    out = run(engine, [(0, "probe", prompts[3], greedy(max_tokens=12)), (0, "probe2", prompts[4], greedy(max_tokens=12))])
    ids = out["probe"].token_ids
    text = out["probe2"].text
    assert len(text) >= 8, "the probe produced too little text for a stop string"
    return ids[4], text[len(text) // 2 : len(text) // 2 + 3]


def test_overlapped_loop_matches_synchronous(llama_dir, prompts, stop_markers):
    stop_token, stop_string = stop_markers
    reqs = mixed_requests(prompts, stop_token, stop_string)
    ref = run(make_engine(llama_dir, async_scheduling=False), reqs)
    got = run(make_engine(llama_dir, async_scheduling=True), reqs)
    assert_same(got, ref)
    reasons = {rid: c.finish_reason for rid, c in ref.items()}
    assert reasons["r3"] == "stop" and reasons["r4"] == "stop", reasons  # stops really ended requests mid-batch
    assert len(ref["r5"].token_ids) >= 8  # min_tokens held the stop token back
    assert len(ref["r3"].token_ids) < 20


def test_overlapped_loop_aborts_between_dispatch_and_retirement(llama_dir, prompts):
    reqs = [(0, f"r{i}", p, greedy(max_tokens=16)) for i, p in enumerate(prompts)]
    aborts = {3: ["r1"], 6: ["r0", "r5"], 9: ["r7"]}
    ref = run(make_engine(llama_dir, async_scheduling=False), reqs)
    engine = make_engine(llama_dir, async_scheduling=True)
    engine_core_in_flight = []
    original_abort = engine.core.abort

    def abort(rid):
        engine_core_in_flight.append(engine.core.num_in_flight)
        return original_abort(rid)

    engine.core.abort = abort
    got = run(engine, reqs, aborts)
    assert all(n == 1 for n in engine_core_in_flight), engine_core_in_flight  # a batch was in flight
    aborted = {rid for rids in aborts.values() for rid in rids}
    for rid in aborted:
        assert got[rid].finish_reason == "abort"
        n = len(got[rid].token_ids)
        assert got[rid].token_ids == ref[rid].token_ids[:n]  # nothing from the dropped in-flight token
    assert_same(got, ref, skip=aborted)


def test_overlapped_loop_under_forced_preemption(llama_dir, prompts):
    reqs = [(0, f"r{i}", p, greedy(max_tokens=40)) for i, p in enumerate(prompts)]
    reqs.append((0, "s", prompts[2], SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True)))
    small = dict(num_blocks=24)  # 24 blocks of 16 tokens for ~650 tokens of prompts + outputs
    sync_engine = make_engine(llama_dir, async_scheduling=False, **small)
    ref = run(sync_engine, reqs)
    engine = make_engine(llama_dir, async_scheduling=True, **small)
    got = run(engine, reqs)
    assert sync_engine.scheduler.num_preemptions > 0 and engine.scheduler.num_preemptions > 0
    assert_same(got, ref)


def test_overlapped_loop_with_pipeline_parallel(llama_dir, prompts):
    reqs = [(i, f"r{i}", p, greedy(max_tokens=8)) for i, p in enumerate(prompts[:6])]
    ref = run(make_engine(llama_dir, async_scheduling=False), reqs)
    for async_scheduling in (False, True):
        engine = make_engine(llama_dir, async_scheduling=async_scheduling, pipeline_parallel_size=2)
        assert_same(run(engine, reqs), ref)
        assert engine.max_microbatches_in_flight == 2


def test_no_compilation_after_warmup_with_every_sampler_variant(llama_dir, prompts, stop_markers):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), token_budget=64, max_num_seqs=8, num_blocks=96,
                                    max_model_len=256), warmup=True)
    assert engine.wait_until_compiled(timeout=600)
    compiled = engine.runner.num_compilations
    reqs = mixed_requests(prompts, *stop_markers)
    reqs.append((0, "big-k", prompts[1], SamplingParams(temperature=1.0, top_k=200, seed=1, max_tokens=4)))
    reqs.append((0, "lp-only", prompts[2], greedy(max_tokens=3, logprobs=1)))
    run(engine, reqs)
    assert engine.runner.num_compilations == compiled


def test_engine_loop_makes_no_implicit_transfers(llama_dir, prompts):
    """Lean dispatch: the only host arrays a step hands to JAX are its two packed ones, in the two jitted calls
    where the runner allows that transfer (`Stage.upload`), and the sampled tokens come back through the one
    fetch that allows it (`model_runner._to_host`); any other transfer or fetch in the loop would raise here."""
    engine = make_engine(llama_dir, async_scheduling=True)
    reqs = [(i, f"r{i}", p, greedy(max_tokens=6, logprobs=1 if i % 2 else None)) for i, p in enumerate(prompts[:4])]
    reqs.append((1, "s", prompts[5], SamplingParams(temperature=0.7, top_p=0.8, seed=2, max_tokens=5, ignore_eos=True)))
    step = engine.step

    def guarded_step():
        with jax.transfer_guard("disallow"):
            return step()

    engine.step = guarded_step
    got = run(engine, reqs)
    assert all(c.finish_reason == "length" for c in got.values())


def test_engine_and_simulator_drive_the_same_core(llama_dir, prompts, monkeypatch):
    """Both engines postprocess every sampled token in EngineCore._postprocess, with their own executor."""
    seen: list[str] = []
    original = EngineCore._postprocess

    def spy(self, state, sampled, row, now):
        seen.append(type(self.executor).__name__)
        return original(self, state, sampled, row, now)

    monkeypatch.setattr(EngineCore, "_postprocess", spy)
    engine = make_engine(llama_dir, async_scheduling=True)
    run(engine, [(0, "a", prompts[1], greedy(max_tokens=3))])
    sim = SimulatedEngine(SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=256),
                          num_blocks=64)
    sim.add_request("b", 20, SamplingParams(max_tokens=4, ignore_eos=True))
    while sim.has_unfinished_requests():
        sim.step()
    assert isinstance(engine.core, EngineCore) and isinstance(sim.core, EngineCore)
    assert isinstance(sim.core.executor, CostModelExecutor) and engine.core.executor is engine.runner
    assert seen.count("ModelRunner") == 3 and seen.count("CostModelExecutor") == 4
