"""Speculative decoding (n-gram) end to end on a tiny random Llama: greedy tokens equal HF `generate`'s and the
same engine's without speculation, through chunked prefills, mixed batches, both loops, preemption, prefix
caching, stops and max_tokens inside an accepted run, aborts; sampled requests speculate and give the tokens
the same seeds give without speculation; no KV block leaks; nothing compiles after warm-up. Greedy exactness also
at tensor_parallel_size 2 (8 virtual CPU devices, tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from tests.sarathi_jax.engine_helpers import hf_generate, run_staggered
from tests.sarathi_jax.speculation_helpers import serve

MAX_TOKENS = 24
PATTERN_LENGTHS = (3, 5, 9, 13, 30, 70)  # each prompt is its pattern 4 times: 12 ... 280 tokens
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint):
    return hf_checkpoint("llama")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, size=n).tolist() * 4 for n in PATTERN_LENGTHS]


@pytest.fixture(scope="module")
def hf_greedy(llama_dir, prompts):
    return hf_generate(llama_dir, prompts, MAX_TOKENS)


def make_engine(model_dir, speculative_config=NGRAM, **overrides) -> LLMEngine:
    fields = dict(model=model_dir, token_budget=64, max_num_seqs=16, block_size=16, num_blocks=256, max_model_len=512,
                  speculative_config=speculative_config, compilation_cache_dir=None)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields), warmup=False)


def observe(engine) -> list[tuple]:
    """Each dispatched step's chunks as (seq_id, num_new_tokens, draft tokens, is_decode, pending): pending, a
    speculating chunk whose first token is still on the device (the overlapped loop; a lookup guessed it)."""
    steps = []
    engine.runner.observe_steps(lambda chunks, packed, variant: steps.append(
        [(c.seq.seq_id, c.num_new_tokens, c.draft_token_ids, c.is_decode,
          bool(c.draft_token_ids and c.seq.num_pending_tokens)) for c in chunks]))
    return steps


LOOPS = pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "synchronous"])


def assert_no_leak(engine):
    bm = engine.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_total_blocks


@pytest.mark.parametrize("token_budget, async_scheduling, tp", [(16, True, 1), (64, False, 1), (64, True, 1),
                                                                 (64, True, 2)])
def test_greedy_speculation_matches_hf_and_no_speculation(llama_dir, prompts, hf_greedy, token_budget,
                                                           async_scheduling, tp):
    # tp 2: the verification rows' LM head and sampler on the mesh (lookup itself runs on the host)
    engine = make_engine(llama_dir, token_budget=token_budget, async_scheduling=async_scheduling,
                         tensor_parallel_size=tp)
    steps = observe(engine)
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=2)
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_greedy
    if token_budget == 64 and async_scheduling:
        plain = run_staggered(make_engine(llama_dir, None, tensor_parallel_size=tp), prompts, GREEDY, arrive_every=2)
        assert plain == finished
    stats = engine.stats()
    # Proposals were accepted, and some were rejected: both paths ran.
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert stats["spec_mean_accepted_length"] > 1.0
    # One batch mixed a speculating decode, a plain decode and a prefill chunk (under a budget of 16 the
    # prefill chunks take the room that drafts would get: drafts only fill what the batch leaves).
    assert token_budget == 16 or any(any(d for _, _, d, *_ in step) and any(dec and not d for _, _, d, dec, _ in step)
               and any(not dec for *_, dec, _ in step) for step in steps)
    assert max(n for step in steps for _, n, *_ in step) <= token_budget
    assert all(sum(n for _, n, *_ in step) <= token_budget for step in steps)
    # The overlapped loop scheduled verifications while the step before was in flight (no verification in it):
    # their first token was read on the device. The synchronous loop never has a pending token.
    assert any(pending for step in steps for *_, pending in step) == async_scheduling
    assert_no_leak(engine)


def test_per_request_metrics_add_up_to_the_totals(llama_dir, prompts):
    engine = make_engine(llama_dir)
    metrics = {}
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                metrics[out.request_id] = out.metrics
    stats = engine.stats()
    assert sum(m.num_draft_tokens for m in metrics.values()) == stats["spec_num_draft_tokens"]
    assert sum(m.num_accepted_tokens for m in metrics.values()) == stats["spec_num_accepted_tokens"]
    for m in metrics.values():
        if m.num_verify_steps:
            assert 0.0 <= m.acceptance_rate <= 1.0 and 1.0 <= m.mean_accepted_length <= 5.0
    # A token per verification step at least: fewer steps than tokens when drafts were accepted.
    assert len(engine.iteration_log) < 3 * MAX_TOKENS


@LOOPS
def test_preemption_with_speculation_gives_the_same_tokens(llama_dir, prompts, hf_greedy, async_scheduling):
    # Enough blocks to run, too few for all: it preempts (and speculates).
    engine = make_engine(llama_dir, num_blocks=40, async_scheduling=async_scheduling)
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=1)
    assert engine.stats()["num_preemptions"] > 0
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    assert [finished[f"r{i}"] for i in range(len(prompts))] == hf_greedy
    assert_no_leak(engine)


def test_prefix_cache_hits_with_speculation(llama_dir, prompts, hf_greedy):
    engine = make_engine(llama_dir, enable_prefix_caching=True)
    first = run_staggered(engine, prompts, GREEDY)
    again = run_staggered(engine, prompts, GREEDY)  # the same prompts: their full blocks are cached
    assert engine.stats()["prefix_cache_hits"] > 0
    assert [first[f"r{i}"] for i in range(len(prompts))] == hf_greedy
    assert again == first
    engine.block_manager.check_invariants([])


def cut_runs(engine) -> int:
    """Tokens that verification steps accepted but a stop dropped (accepted + 1 per step, less emitted)."""
    stats = engine.stats()
    return stats["spec_num_accepted_tokens"] + stats["spec_num_verify_steps"] - stats["spec_num_emitted_tokens"]


@LOOPS
def test_max_tokens_inside_an_accepted_run(llama_dir, prompts, hf_greedy, async_scheduling):
    # Every max_tokens from 2 to MAX_TOKENS on one prompt: each stops exactly there, as HF's prefix; the
    # drafts are capped so that a run never passes max_tokens, and some runs end on it with several tokens.
    requests = {f"m{m}": (prompts[4], GREEDY.replace(max_tokens=m)) for m in range(2, MAX_TOKENS + 1)}
    engine = make_engine(llama_dir, async_scheduling=async_scheduling)
    outs = serve(engine, requests)
    for m in range(2, MAX_TOKENS + 1):
        last = outs[f"m{m}"][-1]
        assert list(last.token_ids) == hf_greedy[4][:m] and last.finish_reason == "length"
    assert any(len(outs[f"m{m}"][-1].new_token_ids) > 1 for m in range(2, MAX_TOKENS + 1))
    assert_no_leak(engine)


@LOOPS
def test_stop_ids_under_min_tokens_match_no_speculation(llama_dir, prompts, hf_greedy, async_scheduling):
    # One request per (stop id, min_tokens): the verification rows ban the stop ids below min_tokens as the
    # sampling row would, so the tokens are the same with and without speculation. (A tiny random model does
    # not copy its prompt, so its accepted drafts repeat earlier outputs and a stop id ends a request at its
    # first occurrence, before any run: tests/sarathi_jax/core/test_engine_core_speculative.py cuts runs by stop ids.)
    requests = {f"{t}-{m}": (prompts[i], GREEDY.replace(stop_token_ids=(t,), min_tokens=m))
                for i in (3, 4) for t in set(hf_greedy[i][:8]) for m in range(2, 16, 3)}
    spec_engine = make_engine(llama_dir, async_scheduling=async_scheduling)
    spec, plain = serve(spec_engine, requests), serve(make_engine(llama_dir, None), requests)
    for rid in requests:
        assert spec[rid][-1].token_ids == plain[rid][-1].token_ids, rid
        assert spec[rid][-1].finish_reason == plain[rid][-1].finish_reason, rid
    assert sum(out[-1].finish_reason == "stop" for out in spec.values()) > len(requests) // 2
    assert spec_engine.stats()["spec_num_accepted_tokens"] > 0
    assert_no_leak(spec_engine)


@LOOPS
def test_stop_string_inside_an_accepted_run(llama_dir, prompts, hf_greedy, async_scheduling):
    from sarathi_jax.request.tokenizer import load_tokenizer

    # Stop strings: the text of every 2 to 4 consecutive output tokens of two greedy outputs; each request
    # stops where its string first completes, with or without speculation, and some inside a verified run.
    tokenizer = load_tokenizer(llama_dir)
    requests = {}
    for i in (3, 4):
        for n in (2, 3, 4):
            for p in range(MAX_TOKENS - n):
                stop = tokenizer.decode(hf_greedy[i][p : p + n]).strip()
                if stop:
                    requests[f"{i}-{n}-{p}"] = (prompts[i], GREEDY.replace(stop=(stop,)))
    spec_engine = make_engine(llama_dir, async_scheduling=async_scheduling)
    spec, plain = serve(spec_engine, requests), serve(make_engine(llama_dir, None), requests)
    for rid in requests:
        a, b = spec[rid][-1], plain[rid][-1]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), rid
        assert "".join(out.text_delta for out in spec[rid]) == a.text
    assert sum(out[-1].finish_reason == "stop" for out in spec.values()) == len(requests)
    assert cut_runs(spec_engine) > 0
    assert_no_leak(spec_engine)


@LOOPS
def test_logprobs_min_tokens_and_sampled_requests_match_no_speculation(llama_dir, prompts, hf_greedy, async_scheduling):
    # min_tokens bans a stop id that the greedy output holds early: the verification rows must ban it too.
    banned = hf_greedy[3][1]
    requests = {
        "lp": (prompts[3], GREEDY.replace(logprobs=2)),
        "min": (prompts[3], GREEDY.replace(stop_token_ids=(banned,), min_tokens=6)),
        "sampled": (prompts[2], SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=12, ignore_eos=True)),
        "nucleus": (prompts[4], SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=4, max_tokens=MAX_TOKENS,
                                               ignore_eos=True)),
        # top_k=1 keeps one token: sampling is greedy, so the tokens are HF's greedy ones.
        "top1": (prompts[3], SamplingParams(temperature=0.7, top_k=1, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)),
        "greedy": (prompts[1], GREEDY),
    }

    spec_engine = make_engine(llama_dir, async_scheduling=async_scheduling)
    spec, plain = serve(spec_engine, requests), serve(make_engine(llama_dir, None), requests)
    for rid in requests:
        assert spec[rid][-1].token_ids == plain[rid][-1].token_ids, rid
    assert banned in spec["min"][-1].token_ids[6:] or spec["min"][-1].finish_reason == "length"
    assert banned not in spec["min"][-1].token_ids[:6]
    lp_spec = [lp for out in spec["lp"] for lp in out.new_logprobs]
    lp_plain = [lp for out in plain["lp"] for lp in out.new_logprobs]
    assert [lp.token_id for lp in lp_spec] == [lp.token_id for lp in lp_plain] == list(spec["lp"][-1].token_ids)
    assert [lp.top_token_ids for lp in lp_spec] == [lp.top_token_ids for lp in lp_plain]
    np.testing.assert_allclose([lp.logprob for lp in lp_spec], [lp.logprob for lp in lp_plain], atol=1e-4)
    assert list(spec["top1"][-1].token_ids) == hf_greedy[3]
    # Sampled requests speculate (their tokens are the plain run's, with the same seeds: asserted above).
    assert all(spec[rid][-1].metrics.num_draft_tokens > 0 for rid in ("sampled", "nucleus", "top1"))
    assert spec["top1"][-1].metrics.num_accepted_tokens > 0
    assert spec["lp"][-1].metrics.num_accepted_tokens > 0
    assert_no_leak(spec_engine)


def test_abort_during_a_speculation_frees_everything(llama_dir, prompts):
    engine = make_engine(llama_dir)  # overlapped loop: the verifying batch is in flight after step()
    steps = observe(engine)
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", prompt, GREEDY)
    aborted, after = None, []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if aborted is not None:
            after += [o for o in outs if o.request_id == aborted]
        elif steps and any(d for _, _, d, *_ in steps[-1]) and engine.core.num_in_flight:
            aborted = next(rid for rid, _, d, *_ in steps[-1] if d)
            assert engine.abort(aborted)
    assert aborted is not None
    # The abort's own output, then nothing: the in-flight verification's tokens are dropped.
    assert len(after) == 1 and after[0].finish_reason == "abort"
    assert_no_leak(engine)


def test_no_compilation_after_warmup_with_speculation(llama_dir, prompts):
    engine = LLMEngine(EngineConfig(model=llama_dir, token_budget=64, max_num_seqs=8, num_blocks=256,
                                    max_model_len=512, speculative_config=NGRAM, compilation_cache_dir=None),
                       warmup=True)
    assert engine.wait_until_compiled(timeout=600)
    compiled = engine.runner.num_compilations
    run_staggered(engine, prompts, GREEDY, arrive_every=1)
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    # Sampled requests' verification rows run the sampled variants warm-up compiled, on the same row ladder.
    drafts = engine.stats()["spec_num_draft_tokens"]
    run_staggered(engine, prompts, SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True), arrive_every=1)
    assert engine.stats()["spec_num_draft_tokens"] > drafts
    assert engine.runner.num_compilations == compiled
