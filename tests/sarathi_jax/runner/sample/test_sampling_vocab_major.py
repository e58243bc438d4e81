"""The greedy-only sampler on vocab-major logits: the tokens of numpy's argmax (banned ids removed) and of
`sample` on the same logits, logprobs of a float64 log-softmax; and the LM head + sampler executable that takes
this path on a CPU gives the tokens of the [R, vocab] path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sarathi_jax.runner.input_batch import make_sampling_arrays
from sarathi_jax.parallel.stages import LMHead
from sarathi_jax.runner.sample.sampler import FULL_VARIANT, sample_jit, sample_packed_jit
from sarathi_jax.runner.sample.inputs import MAX_BANNED, SAMPLER_VARIANTS
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.runner.sample.vocab_major import GREEDY_ONLY, greedy_vocab_major
from sarathi_jax.runner.step_inputs import pack_sampling
from tests.sarathi_jax.sampling_oracle import S, V, WIDE_V, random_logits, row

greedy_vocab_major_jit = jax.jit(greedy_vocab_major)


def _reference(logits: np.ndarray, banned: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """float64: np.argmax of each row with its banned ids at -inf (first index on ties), log_softmax[token]."""
    x = np.asarray(logits, np.float64)
    masked = x.copy()
    for r, ids in enumerate(banned):
        masked[r, list(ids)] = -np.inf
    tokens = np.argmax(masked, axis=-1)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return tokens, x[np.arange(len(x)), tokens] - lse


def test_greedy_only_is_one_of_the_sampler_variants() -> None:
    assert GREEDY_ONLY in SAMPLER_VARIANTS and not GREEDY_ONLY.sampled and not GREEDY_ONLY.logprobs


@pytest.mark.parametrize("v", [V, WIDE_V])
@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_tokens_are_numpy_argmax_and_equal_samples(v: int, seed: int, with_ties: bool) -> None:
    rng = np.random.default_rng(seed)
    # Small integer logits make ties common: the first index must win.
    logits = rng.integers(-3, 3, (S, v)).astype(np.float32) if with_ties else random_logits(rng, (S, v))
    banned = [tuple(int(t) for t in rng.choice(v, size=int(rng.integers(0, 4)), replace=False)) for _ in range(S)]
    rows = [row(temperature=0.0, banned=b) for b in banned]
    arrays = make_sampling_arrays(rows, S)
    tokens, logprobs = jax.device_get(greedy_vocab_major_jit(jnp.asarray(logits.T), arrays))
    want_tokens, want_logprobs = _reference(logits, banned)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
    out = jax.device_get(sample_jit(jnp.asarray(logits), arrays, variant=GREEDY_ONLY))
    np.testing.assert_array_equal(tokens, out.token_ids)
    np.testing.assert_allclose(logprobs, out.logprobs, rtol=1e-6, atol=1e-6)


def test_all_banned_and_nan_rows_match_the_row_major_sampler() -> None:
    v = MAX_BANNED  # a vocabulary whose every id one row can ban
    logits = random_logits(np.random.default_rng(1), (S, v))
    logits[2] = np.nan
    rows = [row(temperature=0.0) for _ in range(S)]
    rows[3] = row(temperature=0.0, banned=tuple(range(v)))
    arrays = make_sampling_arrays(rows, S)
    tokens, _ = jax.device_get(greedy_vocab_major_jit(jnp.asarray(logits.T), arrays))
    out = jax.device_get(sample_jit(jnp.asarray(logits), arrays, variant=GREEDY_ONLY))
    np.testing.assert_array_equal(tokens, out.token_ids)
    assert tokens[2] == v - 1 and tokens[3] == 0


def test_the_vocab_major_head_samples_the_tokens_of_the_row_major_head() -> None:
    """The sampler executable with a vocab-major greedy head: tokens, logprobs and (empty) top logprobs of the
    [R, vocab] head, for a greedy-only batch; other variants ignore the flag."""
    s, embed, vocab = 64, 32, 1000
    rng = np.random.default_rng(5)
    hidden = jnp.asarray(rng.normal(size=(s, embed)).astype(np.float32))
    weight = jnp.asarray(rng.normal(size=(vocab, embed)).astype(np.float32))  # [vocab, embed], tied or not
    row_major = LMHead(dtype=np.dtype(np.float32))
    vocab_major = LMHead(dtype=np.dtype(np.float32), vocab_major_greedy=True)
    rows = [(SamplingParams(temperature=0.0, min_tokens=3), 0, 0, (7, 11)) for _ in range(5)]
    part = pack_sampling(make_sampling_arrays(rows, s))
    np.testing.assert_allclose(np.asarray(vocab_major.logits_vocab_major(hidden, weight)).T,
                               np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64).T, rtol=1e-5, atol=1e-4)
    for r in (4, 8, 64):  # 64 > MAX_ROWS: the row-major path
        for variant in (GREEDY_ONLY, FULL_VARIANT):
            want = jax.device_get(sample_packed_jit(hidden, weight, part, variant=variant, rows=r, head=row_major))
            got = jax.device_get(sample_packed_jit(hidden, weight, part, variant=variant, rows=r, head=vocab_major))
            np.testing.assert_array_equal(got.token_ids, want.token_ids)
            np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got.top_token_ids, want.top_token_ids)
            np.testing.assert_array_equal(got.top_logprobs, want.top_logprobs)
