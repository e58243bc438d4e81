"""Device sampler truncation: top-k, top-p and min-p masks (vLLM's order and semantics) against the
distribution, row by row, for wide k and nuclei, and the exact radix-select top-k / top-p against a float64 sort."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sarathi_jax.runner.sample.sampler import _kth_of_candidates, _top_k_top_p_thresholds
from sarathi_jax.runner.sample.inputs import TOP_K_CANDIDATES
from tests.sarathi_jax.sampling_oracle import N_DIST, S, V, WIDE_V, chi_square_ok, random_logits, row, run, softmax64


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_never_leaves_the_top_k(k: int) -> None:
    logits_row = random_logits(np.random.default_rng(4 + k), (1, V))[0]
    logits = np.tile(logits_row, (N_DIST, 1))
    out = run(logits, [row(seed=i, top_k=k) for i in range(N_DIST)])
    top = np.argsort(-logits_row)[:k]
    assert set(out.token_ids.tolist()) <= set(top.tolist())
    expected = np.zeros(V)
    expected[top] = softmax64(logits_row[top])
    ok, stat, bound = chi_square_ok(out.token_ids, expected)
    assert ok, (stat, bound)


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    return order[before < top_p]


@pytest.mark.parametrize("quantile", [0.2, 0.6, 0.9])
def test_top_p_never_leaves_the_nucleus(quantile: float) -> None:
    rng = np.random.default_rng(int(quantile * 100))
    logits_row = random_logits(rng, (1, V))[0]
    probs = softmax64(logits_row)
    cum = np.cumsum(np.sort(probs)[::-1])
    # top_p midway between two cumulative sums: the nucleus is unambiguous despite float32 rounding.
    i = int(np.searchsorted(cum, quantile))
    top_p = float((cum[i] + cum[i - 1]) / 2) if i > 0 else float(cum[0] / 2)
    keep = nucleus(probs, top_p)
    assert 1 <= len(keep) < V
    logits = np.tile(logits_row, (N_DIST, 1))
    out = run(logits, [row(seed=i, top_p=top_p) for i in range(N_DIST)])
    assert set(out.token_ids.tolist()) <= set(keep.tolist())
    expected = np.zeros(V)
    expected[keep] = probs[keep] / probs[keep].sum()
    ok, stat, bound = chi_square_ok(out.token_ids, expected)
    assert ok, (stat, bound)


def test_top_p_applies_to_the_top_k_renormalised_distribution_then_min_p() -> None:
    rng = np.random.default_rng(11)
    logits_row = random_logits(rng, (1, V))[0]
    k, temperature = 12, 0.8
    scaled = logits_row / temperature
    top = np.argsort(-scaled)[:k]
    probs_k = np.zeros(V)
    probs_k[top] = softmax64(scaled[top])
    cum = np.cumsum(np.sort(probs_k)[::-1])
    top_p = float((cum[3] + cum[4]) / 2)  # nucleus = 5 tokens of the top-k distribution
    keep = nucleus(probs_k, top_p)
    assert len(keep) == 5
    min_p = float(probs_k[keep].min() / probs_k.max()) * 1.01  # drops the nucleus' least likely token
    keep = keep[probs_k[keep] >= min_p * probs_k.max()]
    assert len(keep) == 4
    logits = np.tile(logits_row, (N_DIST, 1))
    rows = [row(seed=i, temperature=temperature, top_k=k, top_p=top_p, min_p=min_p) for i in range(N_DIST)]
    out = run(logits, rows)
    assert set(out.token_ids.tolist()) <= set(keep.tolist())
    expected = np.zeros(V)
    expected[keep] = probs_k[keep] / probs_k[keep].sum()
    ok, stat, bound = chi_square_ok(out.token_ids, expected)
    assert ok, (stat, bound)


@pytest.mark.parametrize("v", [V, WIDE_V])
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_truncation_masks_hold_row_by_row(v: int, seed: int) -> None:
    """Mixed batch, each row its own settings: a sampled token always lies inside the row's allowed set.

    With v = WIDE_V some rows have k or a nucleus wider than 128 tokens."""
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, (S, v), scale=float(rng.choice([0.3, 3.0])))
    rows, allowed = [], []
    for i in range(S):
        k = int(rng.choice([0, 1, 4, 20, 150, 250]))
        top_p = float(rng.choice([1.0, 0.99, 0.95, 0.5]))
        min_p = float(rng.choice([0.0, 0.0, 0.1]))
        temperature = float(rng.choice([0.5, 1.0, 1.5]))
        rows.append(row(seed=int(rng.integers(2**31)), temperature=temperature, top_k=k, top_p=top_p, min_p=min_p))
        scaled = logits[i].astype(np.float64) / temperature
        probs = softmax64(scaled)
        if k:
            cut = np.sort(scaled)[::-1][min(k, v) - 1]
            probs = np.where(scaled >= cut, probs, 0.0)
            probs /= probs.sum()
        ok = set(nucleus(probs, top_p * (1 + 1e-4)).tolist())  # slack for float32 rounding at the boundary
        ok &= set(np.nonzero(probs >= min_p * probs.max() * (1 - 1e-4))[0].tolist())
        allowed.append(ok)
    out = run(logits, rows)
    for i in range(S):
        assert int(out.token_ids[i]) in allowed[i], (i, rows[i][0])


@pytest.mark.parametrize("k, top_p", [(200, 1.0), (0, "wide"), (250, "wide")])
def test_wide_top_k_and_nuclei_match_the_distribution(k: int, top_p: float | str) -> None:
    """k > 128 and nuclei wider than 128 tokens (beyond what one lax.top_k of 128 candidates could give)."""
    rng = np.random.default_rng(k)
    logits_row = random_logits(rng, (1, WIDE_V), scale=0.3)[0]
    probs = softmax64(logits_row)
    if k:
        top = np.argsort(-logits_row)[:k]
        probs = np.zeros(WIDE_V)
        probs[top] = softmax64(logits_row[top])
    keep = np.nonzero(probs)[0]
    if top_p == "wide":
        cum = np.cumsum(np.sort(probs)[::-1])
        top_p = float((cum[179] + cum[180]) / 2)  # nucleus of 181 tokens > 128 candidates
        keep = nucleus(probs, top_p)
        assert len(keep) == 181
    logits = np.tile(logits_row, (N_DIST, 1))
    out = run(logits, [row(seed=i, top_k=k, top_p=top_p) for i in range(N_DIST)])
    assert set(out.token_ids.tolist()) <= set(keep.tolist())
    expected = np.zeros(WIDE_V)
    expected[keep] = probs[keep] / probs[keep].sum()
    ok, stat, bound = chi_square_ok(out.token_ids, expected)
    assert ok, (stat, bound)


# ----------------------------------------------------------------------------------------------- exact top-k / top-p


EXACT_V = 20_000  # nuclei of thousands of tokens


def numpy_top_k_top_p(
    masked: np.ndarray, probs: np.ndarray, k: int, top_p: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """float64 sort-based reference: (top-k keep, renormalised top-k probs, top-p target)."""
    keep_k = masked >= np.sort(masked)[::-1][k - 1] if 0 < k < len(masked) else np.ones(len(masked), bool)
    probs_k = np.where(keep_k, probs.astype(np.float64), 0.0)
    return keep_k, probs_k, top_p * probs_k.sum()


@pytest.mark.parametrize("scale", [0.05, 0.5, 3.0])
def test_exact_top_k_and_top_p_match_a_float64_sort(scale: float) -> None:
    rng = np.random.default_rng(int(scale * 100))
    n = 12
    masked = (rng.standard_normal((n, EXACT_V)) * scale).astype(np.float32)
    masked[1] = rng.integers(-3, 3, EXACT_V)  # heavy ties: the k-th value is shared by thousands of tokens
    masked[2, rng.choice(EXACT_V, 500, replace=False)] = -np.inf  # banned tokens
    masked[3] = -np.abs(masked[3]) - 0.01
    masked[3, :7], masked[3, 7:14] = 0.0, -0.0  # the top 14 are +-0 and k = 7: -0.0 == 0.0, all 14 kept
    temperature = np.float32(0.7)
    probs = np.exp((masked - masked.max(-1, keepdims=True)) / temperature).astype(np.float32)
    ks = np.array([0, 1000, 5000, 7, 1, 129, EXACT_V - 1, EXACT_V, 0, 19_000, 3000, 0], np.int32)
    top_ps = np.array([0.9, 1.0, 0.5, 1.0, 0.9, 0.99, 0.95, 0.3, 0.999, 0.9, 0.75, 1e-6], np.float32)
    want_k, want_p = (ks > 0) & (ks < EXACT_V), top_ps < 1.0
    kth, t = jax.jit(_top_k_top_p_thresholds)(
        jnp.asarray(masked), jnp.asarray(probs), jnp.asarray(ks), jnp.asarray(top_ps), jnp.asarray(want_k),
        jnp.asarray(want_p),
    )
    kth, t = np.asarray(kth), np.asarray(t)
    sizes = []
    for i in range(n):
        keep_k, probs_k, target = numpy_top_k_top_p(masked[i], probs[i], int(ks[i]), float(top_ps[i]))
        np.testing.assert_array_equal(masked[i] >= kth[i], keep_k, err_msg=f"top-k row {i}")
        if not want_p[i]:
            assert t[i] == 0.0
            continue
        order = np.argsort(-probs_k, kind="stable")
        exact = probs_k[order][np.argmax(np.cumsum(probs_k[order]) >= target)]  # smallest top set reaching it
        kept = probs_k >= t[i]
        sizes.append(int(kept.sum()))
        assert probs_k.max() >= t[i] > 0  # the most likely token always stays
        if t[i] != exact:
            # Only a boundary within float32 rounding of the target may move: the kept set still reaches the
            # target and dropping its least likely tokens would not (both within 1e-5 relative), and at most
            # one distinct value moves.
            assert probs_k[kept].sum() >= target * (1 - 1e-5), (i, t[i], exact)
            assert probs_k[probs_k > t[i]].sum() < target * (1 + 1e-5), (i, t[i], exact)
            lo, hi = sorted((float(t[i]), float(exact)))
            assert len(np.unique(probs_k[(probs_k >= lo) & (probs_k <= hi)])) <= 2, i
    assert (masked[3] >= kth[3]).sum() == 14
    assert max(sizes) > 2000  # nuclei of thousands of tokens were exercised


@pytest.mark.parametrize("scale", [0.05, 3.0])
def test_top_k_candidates_keep_the_exact_top_k(scale: float) -> None:
    """The "top_k" filter's k-th of TOP_K_CANDIDATES candidates keeps the same set as the radix top-k and a
    float64 sort, for every k <= TOP_K_CANDIDATES, ties, +-0 and banned (-inf) tokens included."""
    rng = np.random.default_rng(int(scale * 100))
    n = 10
    masked = (rng.standard_normal((n, EXACT_V)) * scale).astype(np.float32)
    masked[1] = rng.integers(-3, 3, EXACT_V)  # heavy ties
    masked[2, rng.choice(EXACT_V, 500, replace=False)] = -np.inf
    masked[3] = -np.abs(masked[3]) - 0.01
    masked[3, :7], masked[3, 7:14] = 0.0, -0.0  # k = 7 of 14 +-0: all 14 kept
    masked[4, 100:] = -np.inf  # k = TOP_K_CANDIDATES > the 100 finite tokens: the -inf tokens tie, all kept
    ks = np.array([50, 100, 1, 7, TOP_K_CANDIDATES, TOP_K_CANDIDATES - 1, 2, 0, 64, 3], np.int32)
    want_k = ks > 0
    probs = np.exp(masked - masked.max(-1, keepdims=True)).astype(np.float32)
    kth = np.asarray(jax.jit(_kth_of_candidates)(jnp.asarray(masked), jnp.asarray(ks), jnp.asarray(want_k)))
    radix_kth, _ = jax.jit(_top_k_top_p_thresholds)(
        jnp.asarray(masked), jnp.asarray(probs), jnp.asarray(ks), jnp.ones(n, jnp.float32), jnp.asarray(want_k),
        jnp.zeros(n, bool),
    )
    radix_kth = np.asarray(radix_kth)
    for i in range(n):
        keep_k, _, _ = numpy_top_k_top_p(masked[i], probs[i], int(ks[i]), 1.0)
        np.testing.assert_array_equal(masked[i] >= kth[i], keep_k, err_msg=f"row {i}")
        np.testing.assert_array_equal(masked[i] >= radix_kth[i], keep_k, err_msg=f"row {i}")
    assert np.isneginf(kth[7]) and np.isneginf(kth[4])
    assert (masked[3] >= kth[3]).sum() == 14
