"""`python -m benchmarks.probes.speculation`'s measuring pass (`run`) on a tiny HF Llama: the same
tokens with and without n-gram speculation, the speculating engine's drafts counted, and the time between
tokens read from the best pass's requests. No timing assertions (speed lives in the benchmark)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sarathi_jax import LLM, SamplingParams
from benchmarks.probes import speculation as probe


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint):
    return hf_checkpoint("llama")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_run_reports_rate_tokens_and_tbt(llama_dir, async_scheduling):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, size=6).tolist() * 5 for _ in range(2)]  # repeats: lookup finds drafts
    params = SamplingParams(temperature=0.0, max_tokens=12)
    results = {}
    for spec in (None, probe.draft_config("ngram", 3)):
        llm = LLM(llama_dir, speculative_config=spec, async_scheduling=async_scheduling, token_budget=64,
                  max_num_seqs=8, max_model_len=256, compilation_cache_dir=None)
        results[spec is not None] = probe.run(llm, prompts, params, repeats=2)
    (plain_rate, plain_tokens, _, _, plain_tbt), (rate, tokens, stats, overlap, tbt) = results[False], results[True]
    assert tokens == plain_tokens and all(len(t) == 12 for t in tokens)
    assert plain_rate > 0 and rate > 0 and 0.0 <= overlap <= 1.0
    assert stats["spec_num_draft_tokens"] > 0  # the speculating passes did speculate
    for p50, p99 in (plain_tbt, tbt):
        assert math.isfinite(p50) and math.isfinite(p99) and 0.0 <= p50 <= p99
    assert plain_tbt[0] > 0.0  # one token per step: every gap is a step's time
