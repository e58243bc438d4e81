"""The general rejection-sampling step (`sarathi_jax.runner.sample.rejection.rejection_sample`) on a tiny vocabulary:
with deliberately bad drafts (dense and point-mass), the tokens it returns are distributed as the target's
processed distribution (Pearson chi-square, fixed seeds, significance 0.001), it accepts as often as the
theory says (sum min(p, q)), and it holds no data-dependent control flow. The engine's point-mass path (the
target's own sample compared with the draft) is tested end to end in test_speculative_sampled.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from sarathi_jax.runner.sample.rejection import rejection_sample, rejection_sample_jit
from tests.sarathi_jax.runner.sample.test_sampling_inputs import all_jaxprs

V, N = 8, 200_000
ALPHA = 1e-3  # significance of each chi-square test (the seeds are fixed: a pass or fail is reproducible)


def target() -> np.ndarray:
    """softmax(logits / 0.7) with a top-k of 5: three tokens have probability 0."""
    logits = np.array([1.5, 0.2, -0.4, 2.0, -1.0, 0.9, -2.0, 0.1])
    p = np.exp((logits - logits.max()) / 0.7)
    p[np.argsort(logits)[:3]] = 0.0
    return p / p.sum()


def draw(p: np.ndarray, q: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """N rows of one step: drafts from q, the tokens and acceptances the sampler returns."""
    rng = np.random.default_rng(seed)
    drafts = rng.choice(V, size=N, p=q)
    tokens, accepted = rejection_sample_jit(
        jnp.asarray(np.tile(p, (N, 1)), jnp.float32), jnp.asarray(np.tile(q, (N, 1)), jnp.float32),
        jnp.asarray(drafts, jnp.int32), jnp.asarray(rng.random(N), jnp.float32),
        jnp.asarray(rng.random(N), jnp.float32))
    return drafts, np.asarray(tokens), np.asarray(accepted)


def assert_distributed_as(tokens: np.ndarray, p: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=V)
    assert counts[p == 0].sum() == 0, counts  # nothing outside the target's support
    support = p > 0
    result = stats.chisquare(counts[support], N * p[support])
    assert result.pvalue > ALPHA, (counts, N * p, result)


BAD_DENSE = np.array([0.05, 0.05, 0.05, 0.0, 0.4, 0.05, 0.35, 0.05])  # most mass where p is 0 or small


@pytest.mark.parametrize("q", [BAD_DENSE, np.full(V, 1 / V)], ids=["bad", "uniform"])
def test_dense_draft_gives_the_target_distribution(q):
    p = target()
    drafts, tokens, accepted = draw(p, q, seed=1)
    assert_distributed_as(tokens, p)
    # Accepted rows keep their draft, rejected ones never do.
    assert (tokens[accepted] == drafts[accepted]).all() and (tokens[~accepted] != drafts[~accepted]).all()
    # The acceptance rate is sum min(p, q) (5 binomial sigmas).
    rate, expected = accepted.mean(), np.minimum(p, q).sum()
    assert abs(rate - expected) < 5 * np.sqrt(expected * (1 - expected) / N), (rate, expected)


@pytest.mark.parametrize("draft", [2, 4, 3], ids=["unlikely", "filtered-out", "likeliest"])
def test_point_mass_draft_gives_the_target_distribution(draft):
    # Prompt lookup's proposal: q = onehot(d). Accepted with probability p(d), else p without d.
    p = target()
    q = np.eye(V)[draft]
    drafts, tokens, accepted = draw(p, q, seed=2)
    assert (drafts == draft).all()
    assert_distributed_as(tokens, p)
    rate = accepted.mean()
    assert abs(rate - p[draft]) < 5 * np.sqrt(max(p[draft] * (1 - p[draft]), 1e-12) / N) + 1e-9, (rate, p[draft])


def test_equal_distributions_accept_every_draft():
    p = target()
    drafts, tokens, accepted = draw(p, p, seed=3)
    assert accepted.all() and (tokens == drafts).all()


def test_no_data_dependent_control_flow():
    r = 16
    closed = jax.make_jaxpr(rejection_sample)(jnp.zeros((r, 300)), jnp.zeros((r, 300)), jnp.zeros(r, jnp.int32),
                                              jnp.zeros(r), jnp.zeros(r))
    primitives = {eqn.primitive.name for jaxpr in all_jaxprs(closed.jaxpr) for eqn in jaxpr.eqns}
    assert not primitives & {"cond", "while", "scan"}, primitives
