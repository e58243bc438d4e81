"""The bench's speculation counts: a run of a speculating engine reports its own drafts, accepted drafts,
verification steps and emitted tokens (not the engine's running totals), and the report prints them."""

from __future__ import annotations

import numpy as np
import pytest

from sarathi_jax import EngineConfig, LLMEngine
from sarathi_jax.bench.driver import run_workload
from sarathi_jax.bench.report import speculation_line
from sarathi_jax.bench.workload import synthetic_workload

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint):
    return hf_checkpoint("llama")


def _engine(model_dir, speculative_config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, token_budget=64, max_num_seqs=8, block_size=16, num_blocks=128,
                                  max_model_len=256, speculative_config=speculative_config,
                                  compilation_cache_dir=None))


def test_each_run_reports_its_own_speculation(llama_dir):
    wl = synthetic_workload(6, qps=100.0, prompt_len="48", output_len="16", seed=2)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, size=8).tolist() * 6 for _ in range(len(wl))]  # repeats: lookup finds drafts
    engine = _engine(llama_dir, NGRAM)
    first = run_workload(engine, wl, prompts, id_prefix="a").speculation
    second = run_workload(engine, wl, prompts, id_prefix="b").speculation
    assert first is not None and first["draft_tokens"] > 0 and first["verify_steps"] > 0
    assert 0 <= first["accepted_tokens"] <= first["draft_tokens"]
    # each verification step emits its accepted drafts and one more token, unless max_tokens cut the run
    assert first["verify_steps"] <= first["emitted_tokens"] <= first["accepted_tokens"] + first["verify_steps"]
    assert first["emitted_tokens"] <= len(wl) * 16
    assert second is not None and second["draft_tokens"] > 0
    totals = engine.stats()  # the engine's running totals are the two runs' sums: each run reports its own part
    for key in first:
        assert totals[f"spec_num_{key}"] == first[key] + second[key], key
    line = speculation_line(first)
    assert f"{first['draft_tokens']} draft tokens, {first['accepted_tokens']} accepted (acceptance " in line
    assert run_workload(_engine(llama_dir, None), wl, prompts).speculation is None
