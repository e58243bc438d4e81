"""Rejection sampling with a draft model's own distribution, on the real engine path (`LLMEngine`: scheduler,
draft runner, model runner, sampler, verification step): a tiny-vocabulary Llama target, a deliberately bad
draft (another random Llama with the target's vocabulary, so q is far from p), many seeded requests. The
empirical distributions of emitted positions 1, 2 and 3 (position 1 the prefill's plain sample, 2 and 3 the
verified drafts: k = 2) match the target's marginals computed from HF's logits with the same temperature and
top-k (Pearson chi-square, significance ALPHA, fixed seeds). Accepting every draft (or comparing a plain
sample with a dense draft) makes positions 2 and 3 follow the draft instead, which the test detects (checked
by hand)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from sarathi_jax import SamplingParams
from tests.conftest import PARALLEL_LLAMA, write_hf_checkpoint
from tests.sarathi_jax.speculation_helpers import assert_no_leak, hf_model, make_engine, serve

VOCAB, TEMPERATURE, TOP_K = 8, 0.6, 6
NUM_REQUESTS = 720
ALPHA = 1e-3  # significance of each chi-square test
PROMPT = [3, 5, 1, 6, 2, 7]
CONFIG = {**PARALLEL_LLAMA, "vocab_size": VOCAB, "num_hidden_layers": 2, "bos_token_id": 0, "eos_token_id": 1}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("target-v8"), "LlamaForCausalLM", CONFIG, seed=11)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("draft-v8"), "LlamaForCausalLM", CONFIG, seed=12)


def processed(logits: torch.Tensor) -> np.ndarray:
    """The request's distribution from raw logits (float64): temperature, then top-k (ties kept)."""
    scaled = logits.double().numpy() / TEMPERATURE
    scaled[scaled < np.sort(scaled)[-TOP_K]] = -np.inf
    p = np.exp(scaled - scaled.max())
    return p / p.sum()


def marginals(model_dir, positions: int) -> list[np.ndarray]:
    """Each emitted position's marginal distribution after PROMPT under `model_dir`'s processed distribution:
    the sum over every earlier continuation of its probability times the next-token distribution."""
    model = hf_model(model_dir)
    out, prefixes = [], {(): 1.0}
    with torch.no_grad():
        for _ in range(positions):
            marginal, nxt = np.zeros(VOCAB), {}
            for prefix, weight in prefixes.items():
                p = processed(model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1])
                marginal += weight * p
                for t in np.flatnonzero(p):
                    nxt[prefix + (int(t),)] = weight * p[t]
            out.append(marginal)
            prefixes = nxt
    return out


def chi_square(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """Pearson's p-value, cells expecting fewer than 5 merged into one (a zero-probability cell seen: 0.0)."""
    if counts[expected_p == 0].any():
        return 0.0
    expected = counts.sum() * expected_p
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep]).pvalue)


def test_sampled_drafts_keep_the_target_distribution(target_dir, draft_dir):
    target, draft = marginals(target_dir, 3), marginals(draft_dir, 3)
    # The draft is bad: its marginals are far from the target's (else the test could not see a broken rule).
    assert all(0.5 * np.abs(p - q).sum() > 0.2 for p, q in zip(target[1:], draft[1:]))

    spec = {"model": str(draft_dir), "num_speculative_tokens": 2}
    engine = make_engine(target_dir, spec, max_num_seqs=32)
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=4, ignore_eos=True)
    requests = {f"r{i}": (PROMPT, params.replace(seed=i)) for i in range(NUM_REQUESTS)}
    outs = serve(engine, requests, 10)  # 10 running, 20 drafts: 30 sampling rows of 32
    tokens = np.array([list(outs[rid][-1].token_ids) for rid in requests])
    assert tokens.shape == (NUM_REQUESTS, 4)
    stats_ = engine.stats()
    # Positions 2 and 3 went through verification, with rejections (the draft is bad) and acceptances.
    assert stats_["spec_num_draft_tokens"] >= NUM_REQUESTS
    assert 0.1 < stats_["spec_acceptance_rate"] < 0.9, stats_["spec_acceptance_rate"]
    for position in range(3):
        counts = np.bincount(tokens[:, position], minlength=VOCAB).astype(float)
        pvalue = chi_square(counts, target[position])
        assert pvalue > ALPHA, (position, counts, target[position] * NUM_REQUESTS, pvalue)
    assert_no_leak(engine)

    # Reproducible: a fresh engine given the first requests, grouped alike, gives the same tokens.
    again = serve(make_engine(target_dir, spec, max_num_seqs=32), dict(itertools.islice(requests.items(), 40)), 10)
    assert all(again[rid][-1].token_ids == outs[rid][-1].token_ids for rid in again)
