"""Device sampler: greedy exactness, truncation masks, distributions, seeding, logprobs, banned ids, variants
(host-chosen == most general, no device control flow) and the exact radix-select top-k / top-p."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sarathi_jax.sampling import (
    FULL_VARIANT,
    MAX_BANNED,
    SAMPLER_FILTERS,
    SAMPLER_VARIANTS,
    TOP_K_CANDIDATES,
    SamplerOutput,
    SamplerVariant,
    _kth_of_candidates,
    _top_k_top_p_thresholds,
    make_sampling_arrays,
    sample,
    sample_jit,
    sampler_variant,
)
from sarathi_jax.sampling_params import MAX_LOGPROBS, SamplingParams

# A few fixed shapes so that the whole file compiles each sampler variant only a handful of times.
S, V = 16, 64
WIDE_V = 300  # k and nuclei > 128 tokens (the old top_k-candidates limit), not a multiple of 128-token blocks
N_DIST = 2048  # rows (= samples) for the distribution tests


def run(
    logits: np.ndarray, rows: list, max_num_seqs: int | None = None, variant: SamplerVariant | None = None
) -> SamplerOutput:
    """The jitted sampler on these rows, with the variant the host would pick unless one is given."""
    logits = np.asarray(logits, np.float32)
    arrays = make_sampling_arrays(rows, max_num_seqs or logits.shape[0])
    variant = sampler_variant(rows) if variant is None else variant
    return jax.tree.map(np.asarray, sample_jit(jnp.asarray(logits), arrays, variant=variant))


def row(seed: int = 0, step: int = 0, banned: tuple[int, ...] = (), **params) -> tuple:
    return (SamplingParams(**params), seed, step, banned)


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def chi_square_ok(samples: np.ndarray, probs: np.ndarray) -> tuple[bool, float, float]:
    """Pearson chi-square of sample counts vs probs; bins with expected < 5 are merged. ~5 sigma bound."""
    n = len(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    # Any sample in a zero-probability bin is an outright failure.
    if counts[expected == 0].sum() > 0:
        return False, np.inf, 0.0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = max(int(keep.sum()) - 1, 1)
    bound = dof + 5 * np.sqrt(2 * dof) + 10
    return stat < bound, stat, bound


def random_logits(rng: np.random.Generator, shape: tuple[int, int], scale: float = 2.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ----------------------------------------------------------------------------------------------- greedy


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_greedy_is_numpy_argmax(seed: int, with_ties: bool) -> None:
    rng = np.random.default_rng(seed)
    # Small integer logits make ties common: the first index must win, as in np.argmax.
    logits = rng.integers(-3, 3, (S, V)).astype(np.float32) if with_ties else random_logits(rng, (S, V))
    out = run(logits, [row(temperature=0.0) for _ in range(S)])
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=-1))


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.05, 5.0))
def test_truncations_that_keep_one_token_equal_greedy(seed: int, temperature: float) -> None:
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, (S, V))
    kinds = [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(temperature=1e-6)]
    rows = [row(seed=i, step=i, **{"temperature": temperature, **kinds[i % len(kinds)]}) for i in range(S)]
    out = run(logits, rows)
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=-1))


def test_padding_rows_and_empty_batch() -> None:
    logits = random_logits(np.random.default_rng(0), (S, V))
    out = run(logits, [row(temperature=0.0)])  # one real row, S - 1 padding rows
    assert out.token_ids.shape == (S,) and out.token_ids.dtype == np.int32
    assert out.token_ids[0] == np.argmax(logits[0])
    assert ((out.token_ids >= 0) & (out.token_ids < V)).all()
    empty = run(logits, [])
    assert ((empty.token_ids >= 0) & (empty.token_ids < V)).all()


# ----------------------------------------------------------------------------------------------- seeding


@pytest.mark.parametrize("v", [V, WIDE_V])
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    step=st.integers(0, 10_000),
    position=st.integers(1, S - 1),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_k=st.sampled_from([0, 1, 5, 200, 10_000]),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.3]),
    min_p=st.sampled_from([0.0, 0.05]),
    others=st.integers(0, 2**32 - 1),
)
def test_seeded_row_is_independent_of_batch_and_position(
    v: int, seed: int, step: int, position: int, temperature: float, top_k: int, top_p: float, min_p: float,
    others: int,
) -> None:
    """Same logits, same seed and step -> same token, alone or in a busy batch whose rows need other work
    (greedy, banned ids, small and wide top-k / top-p, logprobs), hence often under another variant."""
    rng = np.random.default_rng(others)
    mine = random_logits(rng, (1, v), scale=float(rng.choice([0.3, 2.0])))[0]
    target = row(seed=seed, step=step, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)

    alone_logits = np.zeros((S, v), np.float32)
    alone_logits[0] = mine
    alone = run(alone_logits, [target])  # row 0, the rest padding

    busy_logits = random_logits(rng, (S, v), scale=0.3)
    busy_logits[position] = mine
    choices = [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=3),
        dict(temperature=0.7, top_p=0.5),
        dict(temperature=1.3, min_p=0.2, logprobs=5),
        dict(temperature=1.0, top_k=10, top_p=0.8),
        dict(temperature=1.0, top_k=250, top_p=0.99),
    ]
    busy_rows = [
        row(seed=int(rng.integers(2**31)), step=int(rng.integers(100)),
            banned=tuple(int(t) for t in rng.choice(v, 3, replace=False)), **choices[i % len(choices)])
        for i in range(S)
    ]
    busy_rows[position] = target
    busy = run(busy_logits, busy_rows)
    assert busy.token_ids[position] == alone.token_ids[0]
    assert busy.logprobs[position] == alone.logprobs[0]


def test_seed_and_step_drive_the_randomness() -> None:
    logits = np.zeros((S, V), np.float32)  # uniform distribution
    same = run(logits, [row(seed=7, step=3) for _ in range(S)])
    assert len(set(same.token_ids.tolist())) == 1  # same seed and step -> same token in every row
    steps = run(logits, [row(seed=7, step=i) for i in range(S)])
    seeds = run(logits, [row(seed=1000 + i, step=3) for i in range(S)])
    assert len(set(steps.token_ids.tolist())) > S // 2
    assert len(set(seeds.token_ids.tolist())) > S // 2


# ----------------------------------------------------------------------------------------------- distributions


def test_temperature_one_matches_softmax() -> None:
    logits_row = random_logits(np.random.default_rng(1), (1, V), scale=1.5)[0]
    logits = np.tile(logits_row, (N_DIST, 1))
    out = run(logits, [row(seed=i, step=17) for i in range(N_DIST)])
    ok, stat, bound = chi_square_ok(out.token_ids, softmax64(logits_row))
    assert ok, (stat, bound)


def test_temperature_scales_the_distribution() -> None:
    logits_row = random_logits(np.random.default_rng(2), (1, V), scale=0.7)[0]
    logits = np.tile(logits_row, (N_DIST, 1))
    out = run(logits, [row(seed=i, temperature=0.5) for i in range(N_DIST)])
    ok, stat, bound = chi_square_ok(out.token_ids, softmax64(logits_row / 0.5))
    assert ok, (stat, bound)


def test_distribution_over_many_cdf_blocks() -> None:
    # V not a multiple of the 128-token CDF block, mass spread over every block.
    v = WIDE_V
    logits_row = random_logits(np.random.default_rng(3), (1, v), scale=0.5)[0]
    logits_row[[5, 130, 299]] += 3.0
    logits = np.tile(logits_row, (N_DIST, 1))
    out = run(logits, [row(seed=i) for i in range(N_DIST)])
    ok, stat, bound = chi_square_ok(out.token_ids, softmax64(logits_row))
    assert ok, (stat, bound)


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


# ----------------------------------------------------------------------------------------------- banned ids


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_banned_ids_are_never_sampled(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, (S, V), scale=4.0)
    rows, banned_sets = [], []
    for i in range(S):
        # Ban the most likely tokens (so a banned token is always the argmax) plus a few random ones.
        order = np.argsort(-logits[i])
        n_top = int(rng.integers(1, 4))
        extra = rng.choice(V, int(rng.integers(0, MAX_BANNED - n_top + 1)), replace=True)
        banned = tuple(int(t) for t in np.concatenate([order[:n_top], extra]))
        banned_sets.append(set(banned))
        temperature = 0.0 if i % 2 == 0 else float(rng.choice([0.2, 1.0]))
        rows.append(row(seed=i, banned=banned, temperature=temperature, top_k=int(rng.choice([0, 2]))))
    out = run(logits, rows)
    for i in range(S):
        assert int(out.token_ids[i]) not in banned_sets[i]
        if i % 2 == 0:  # greedy: argmax of the logits with the banned ids removed
            masked = logits[i].copy()
            masked[list(banned_sets[i])] = -np.inf
            assert out.token_ids[i] == np.argmax(masked)


def test_banned_ids_never_sampled_over_many_draws() -> None:
    logits_row = random_logits(np.random.default_rng(5), (1, V))[0]
    banned = tuple(int(t) for t in np.argsort(-logits_row)[:MAX_BANNED])
    logits = np.tile(logits_row, (N_DIST, 1))
    out = run(logits, [row(seed=i, banned=banned) for i in range(N_DIST)])
    assert not set(out.token_ids.tolist()) & set(banned)
    expected = softmax64(logits_row)
    expected[list(banned)] = 0
    ok, stat, bound = chi_square_ok(out.token_ids, expected / expected.sum())
    assert ok, (stat, bound)


def test_all_tokens_banned_still_returns_a_valid_id() -> None:
    logits = random_logits(np.random.default_rng(6), (4, 8))
    everything = tuple(range(8))
    out = run(logits, [row(banned=everything), row(banned=everything, temperature=0.0)])
    assert ((out.token_ids >= 0) & (out.token_ids < 8)).all()


def test_builder_limits() -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        make_sampling_arrays([row(banned=tuple(range(MAX_BANNED + 1)))], S)
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_sampling_arrays([row()] * (S + 1), S)
    arrays = make_sampling_arrays([row(temperature=0.5, top_k=-1, banned=(3, 4), logprobs=2, seed=9)], 4)
    assert arrays.temperature.tolist() == [0.5, -1.0, -1.0, -1.0]  # padding rows are marked < 0
    assert arrays.top_k[0] == 0  # -1 normalised to "off"
    assert arrays.banned_token_ids[0].tolist() == [3, 4] + [-1] * (MAX_BANNED - 2)
    assert arrays.num_logprobs.tolist() == [2, 0, 0, 0]


# ----------------------------------------------------------------------------------------------- logprobs


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_logprobs_match_float64_log_softmax(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, (S, V), scale=5.0)
    # Temperature, masks and banned ids change the sampling, never the reported logprobs.
    rows = [
        row(seed=i, logprobs=MAX_LOGPROBS, temperature=float(rng.choice([0.0, 0.5, 2.0])),
            top_k=int(rng.choice([0, 3])), banned=(int(np.argmax(logits[i])),) if i % 3 == 0 else ())
        for i in range(S)
    ]
    out = run(logits, rows)
    ref = log_softmax64(logits)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(S), out.token_ids], rtol=1e-5, atol=1e-5)
    assert out.top_token_ids.shape == (S, MAX_LOGPROBS) and out.top_logprobs.shape == (S, MAX_LOGPROBS)
    for i in range(S):
        assert (np.diff(out.top_logprobs[i]) <= 0).all()  # most likely first
        np.testing.assert_array_equal(out.top_token_ids[i], np.argsort(-ref[i], kind="stable")[:MAX_LOGPROBS])
        np.testing.assert_allclose(out.top_logprobs[i], ref[i, out.top_token_ids[i]], rtol=1e-5, atol=1e-5)


def test_tiny_vocab_pads_top_logprobs() -> None:
    logits = random_logits(np.random.default_rng(7), (4, 8))
    out = run(logits, [row(temperature=0.0, logprobs=MAX_LOGPROBS)])
    assert out.top_token_ids.shape == (4, MAX_LOGPROBS)
    np.testing.assert_array_equal(out.top_token_ids[0, :8], np.argsort(-logits[0], kind="stable"))
    assert np.isneginf(out.top_logprobs[0, 8:]).all()
    np.testing.assert_allclose(np.exp(out.top_logprobs[0, :8]).sum(), 1.0, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- variants


def test_variants_and_host_choice() -> None:
    assert len(SAMPLER_VARIANTS) == len(set(SAMPLER_VARIANTS)) == 8 and SAMPLER_VARIANTS[-1] == FULL_VARIANT
    assert all(v.sampled or v.filter == "none" for v in SAMPLER_VARIANTS)
    assert {v.filter for v in SAMPLER_VARIANTS} == set(SAMPLER_FILTERS)
    with pytest.raises(ValueError, match="filter"):
        SamplerVariant(sampled=False, filter="top_k", logprobs=False)
    with pytest.raises(ValueError, match="filter"):
        SamplerVariant(sampled=True, filter="top_p", logprobs=False)
    greedy, none, top_k, exact = (
        SamplerVariant(False, "none", False), SamplerVariant(True, "none", False),
        SamplerVariant(True, "top_k", False), SamplerVariant(True, "exact", False),
    )
    assert sampler_variant([]) == greedy
    assert sampler_variant([row(temperature=0.0, top_k=5, top_p=0.5)]) == greedy
    assert sampler_variant([row(temperature=0.0, logprobs=0)]) == greedy
    assert sampler_variant([row(temperature=0.0, logprobs=2)]) == SamplerVariant(False, "none", True)
    assert sampler_variant([row(temperature=1e-6)]) == greedy
    assert sampler_variant([row(min_p=0.5)]) == none
    assert sampler_variant([row(temperature=0.0), row(top_k=3)]) == top_k
    assert sampler_variant([row(top_k=TOP_K_CANDIDATES, min_p=0.1), row(top_k=1), row()]) == top_k
    assert sampler_variant([row(top_k=5), row(temperature=0.0, top_k=500, top_p=0.5)]) == top_k  # greedy: ignored
    assert sampler_variant([row(top_k=TOP_K_CANDIDATES + 1)]) == exact
    assert sampler_variant([row(top_k=50, top_p=0.9)]) == exact
    assert sampler_variant([row(top_k=50), row(top_p=0.99)]) == exact
    assert sampler_variant([row(top_p=0.9), row(temperature=0.0, logprobs=1)]) == FULL_VARIANT


def covers(w: SamplerVariant, variant: SamplerVariant) -> bool:
    """Whether `w` has every capability of `variant` (and so serves every batch that `variant` serves)."""
    rank = SAMPLER_FILTERS.index
    return w.sampled >= variant.sampled and rank(w.filter) >= rank(variant.filter) and w.logprobs >= variant.logprobs


def random_batch(rng: np.random.Generator, v: int) -> list:
    """A mixed batch of up to S rows; each capability (sampling, filters: none, small top-k only or any,
    logprobs) is allowed or not at random, so that every variant gets chosen."""
    allow_sampled, allow_logprobs = rng.random(2) < 0.6
    allow_filter = str(rng.choice(SAMPLER_FILTERS))
    rows = []
    for i in range(int(rng.integers(0, S + 1))):
        params: dict = {"temperature": 0.0}
        if allow_sampled and rng.random() < 0.7:
            params = {"temperature": float(rng.choice([0.3, 1.0, 2.0])), "min_p": float(rng.choice([0.0, 0.05]))}
            if allow_filter == "top_k":  # k <= TOP_K_CANDIDATES, no top-p (k >= v is off on device)
                params["top_k"] = int(rng.choice([0, 1, 5, 50, 127, TOP_K_CANDIDATES]))
            elif allow_filter == "exact":
                params["top_k"] = int(rng.choice([0, 1, 5, 50, 150, 10_000]))
                params["top_p"] = float(rng.choice([1.0, 0.9, 0.3]))
        if allow_logprobs and rng.random() < 0.5:
            params["logprobs"] = int(rng.choice([0, 3, MAX_LOGPROBS]))
        banned = tuple(int(t) for t in rng.choice(v, int(rng.integers(0, 4)), replace=False))
        rows.append(row(seed=int(rng.integers(2**63)), step=int(rng.integers(1000)), banned=banned, **params))
    return rows


@pytest.mark.parametrize("v", [V, WIDE_V])
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
@example(seed=3)  # (both v) filter "top_k" with k up to TOP_K_CANDIDATES, heavy ties
@example(seed=23)  # (both v) filter "top_k" + logprobs
def test_host_chosen_variant_matches_the_full_variant_bitwise(v: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if rng.random() < 0.25:  # heavy ties: the k-th value shared by many tokens
        logits = rng.integers(-3, 3, (S, v)).astype(np.float32)
    else:
        logits = random_logits(rng, (S, v), scale=float(rng.choice([0.3, 3.0])))
    rows = random_batch(rng, v)
    chosen = sampler_variant(rows)
    full = run(logits, rows, variant=FULL_VARIANT)
    # Every variant able to serve these rows (the chosen one's capabilities or more) agrees with the full one.
    covering = [w for w in SAMPLER_VARIANTS if covers(w, chosen)]
    assert chosen in covering
    for variant in covering:
        out = run(logits, rows, variant=variant)
        np.testing.assert_array_equal(out.token_ids, full.token_ids, err_msg=str(variant))
        np.testing.assert_array_equal(out.logprobs, full.logprobs, err_msg=str(variant))
        wants = np.array([(r[0].logprobs or 0) > 0 for r in rows] + [False] * (S - len(rows)))
        if variant.logprobs:
            np.testing.assert_array_equal(out.top_token_ids[wants], full.top_token_ids[wants])
            np.testing.assert_array_equal(out.top_logprobs[wants], full.top_logprobs[wants])
        else:
            assert not wants.any()
            assert (out.top_token_ids == 0).all() and np.isneginf(out.top_logprobs).all()


def all_jaxprs(jaxpr: jex.Jaxpr) -> Iterator[jex.Jaxpr]:
    yield jaxpr
    for sub in jex.subjaxprs(jaxpr):
        yield from all_jaxprs(sub)


@pytest.mark.parametrize("variant", SAMPLER_VARIANTS, ids=str)
def test_no_data_dependent_control_flow(variant: SamplerVariant) -> None:
    """No cond / while anywhere (a GPU would sync with the host on its predicate), nor in the StableHLO a CUDA
    build would compile (lowered here without a GPU)."""
    logits = jnp.zeros((S, WIDE_V), jnp.float32)
    arrays = make_sampling_arrays([], S)
    closed = jax.make_jaxpr(functools.partial(sample, variant=variant))(logits, arrays)
    primitives = {eqn.primitive.name for jaxpr in all_jaxprs(closed.jaxpr) for eqn in jaxpr.eqns}
    assert not primitives & {"cond", "while", "scan"}, primitives
    module = jax.export.export(sample_jit, platforms=["cuda"])(logits, arrays, variant=variant).mlir_module()
    ops = set(re.findall(r"stablehlo\.(\w+)", module))
    assert not ops & {"while", "case", "if"}, ops
    assert ("top_k" in primitives) == (variant.logprobs or variant.filter == "top_k")
    assert ("scatter-add" in primitives) == (variant.filter == "exact")  # the radix-select histograms
    assert ("random_bits" in primitives) == variant.sampled


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
