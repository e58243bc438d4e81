"""Device sampler: greedy exactness, padding, seeding and distributions, banned ids, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sarathi_jax.runner.sample.inputs import MAX_BANNED
from sarathi_jax.request.sampling_params import MAX_LOGPROBS
from tests.sarathi_jax.sampling_oracle import N_DIST, S, V, WIDE_V, chi_square_ok, random_logits, row, run, softmax64


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
