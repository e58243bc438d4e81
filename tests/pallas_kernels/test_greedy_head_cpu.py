"""The C++ greedy LM head (`pallas_kernels/greedy_head_cpu.py`) against its float64 numpy reference and the jnp
greedy sampler, and the sampler executable that takes it.

The kernel must be built (`pip install -e .` builds it); these tests fail, never skip, where it is not. Shapes
cover every code path: rows in one to four vectors of 16 (eight of 8 on AVX2) and their tails; vocabularies
below, at and past a work unit (192 ids) and a register block (6 to 24 weight rows), with tails; any K.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.greedy_head_cpu import MAX_ROWS, greedy_head_cpu, greedy_head_reference, greedy_head_status
from sarathi_jax.runner.input_batch import make_sampling_arrays
from sarathi_jax.parallel.stages import LMHead
from sarathi_jax.runner.sample.sampler import FULL_VARIANT, sample_packed_jit
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.runner.sample.vocab_major import GREEDY_KERNEL_MIN_ROWS, GREEDY_ONLY, greedy_vocab_major
from sarathi_jax.runner.step_inputs import pack_sampling

kernel_module = importlib.import_module("pallas_kernels.greedy_head_cpu")
greedy_head_jit = jax.jit(greedy_head_cpu)


def _banned(rng: np.random.Generator, rows: int, vocab: int, width: int = 3) -> np.ndarray:
    """-1 padded banned ids, some out of range (ignored), about half the rows banning something."""
    banned = np.full((rows, width), -1, np.int32)
    for r in range(0, rows, 2):
        banned[r, : int(rng.integers(1, width + 1))] = rng.choice(vocab, size=1)[0]
        banned[r, -1] = vocab + 5 if r % 4 == 0 else banned[r, -1]  # outside [0, V): ignored
    return banned


def test_kernel_is_built():
    assert greedy_head_status() is None, greedy_head_status()


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 24, 33, 48, 64])
@pytest.mark.parametrize("k,vocab", [(512, 1000), (64, 192), (33, 193), (7, 25), (576, 4099), (1, 3)])
def test_matches_the_float64_reference(rows, k, vocab):
    rng = np.random.default_rng(rows * 1000 + k * 7 + vocab)
    h = rng.standard_normal((rows, k)).astype(np.float32)
    w = (rng.standard_normal((vocab, k)) / np.sqrt(k)).astype(np.float32)
    banned = _banned(rng, rows, vocab)
    tokens, logprobs = jax.device_get(greedy_head_jit(h, w, banned))
    want_tokens, want_logprobs = greedy_head_reference(h, w, banned)
    assert tokens.dtype == np.int32 and logprobs.dtype == np.float32 and tokens.shape == logprobs.shape == (rows,)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [3, 40])
def test_ties_keep_the_first_id(rows):
    """Integer logits (exact in float32 whatever the order of the sums) tie often, across work units too."""
    rng = np.random.default_rng(rows)
    h = np.ones((rows, 2), np.float32)
    w = rng.integers(-3, 3, (1000, 2)).astype(np.float32)
    w[[10, 500, 999]] = 4.0  # the max of every row, at three ids (two units apart)
    banned = np.full((rows, 2), -1, np.int32)
    banned[1, 0] = 10  # row 1: the first max banned, the next one wins
    tokens, _ = jax.device_get(greedy_head_jit(h, w, banned))
    want = np.full(rows, 10)
    want[1] = 500
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_array_equal(tokens, greedy_head_reference(h, w, banned)[0])


def test_nan_all_banned_and_infinite_rows():
    """A NaN row -> the last id (logprob NaN); a NaN only at a banned id -> the argmax of the rest (logprob NaN:
    the raw logits hold it); all banned -> 0; +inf logits -> the first of them."""
    vocab, k = 300, 4
    rng = np.random.default_rng(3)
    h = rng.standard_normal((6, k)).astype(np.float32)
    w = rng.standard_normal((vocab, k)).astype(np.float32)
    w[250, 0] = np.nan  # NaN logits at id 250 for rows with h[:, 0] != 0
    h[3, 0] = 0.0  # ... but 0 * NaN is NaN too
    banned = np.full((6, vocab), -1, np.int32)
    banned[1, 0] = 250  # row 1: the NaN banned
    banned[2] = np.arange(vocab)  # row 2: every id banned
    h[4] = np.inf  # row 4: +-inf and NaN logits
    tokens, logprobs = jax.device_get(greedy_head_jit(h, w, banned))
    want_tokens, want_logprobs = greedy_head_reference(h, w, banned)
    np.testing.assert_array_equal(tokens, want_tokens)
    assert tokens[0] == vocab - 1 and tokens[2] == 0 and tokens[1] != vocab - 1
    np.testing.assert_array_equal(np.isnan(logprobs), np.isnan(want_logprobs))
    finite = np.isfinite(want_logprobs)
    np.testing.assert_allclose(logprobs[finite], want_logprobs[finite], rtol=1e-5, atol=1e-5)
    # Without NaN: an infinite logit wins at its first id.
    w2 = np.zeros((vocab, k), np.float32)
    w2[[7, 9], 0] = np.inf
    h2 = np.ones((2, k), np.float32)
    t2, _ = jax.device_get(greedy_head_jit(h2, w2, np.full((2, 1), -1, np.int32)))
    assert t2.tolist() == [7, 7]


def test_equals_the_jnp_greedy_sampler():
    """Tokens of `greedy_vocab_major` on the same logits, logprobs to float32 rounding."""
    rows, k, vocab = 40, 512, 32000
    rng = np.random.default_rng(9)
    h = rng.standard_normal((rows, k)).astype(np.float32)
    w = (rng.standard_normal((vocab, k)) / np.sqrt(k)).astype(np.float32)
    sampling_rows = [(SamplingParams(temperature=0.0, min_tokens=3), 0, 0, (int(r) * 17,)) for r in range(rows)]
    arrays = make_sampling_arrays(sampling_rows, rows)
    logits_t = jnp.einsum("ve,se->vs", w, h, precision=jax.lax.Precision.HIGHEST)
    want_tokens, want_logprobs = jax.device_get(jax.jit(greedy_vocab_major)(logits_t, arrays))
    tokens, logprobs = jax.device_get(greedy_head_jit(h, w, arrays.banned_token_ids))
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


def test_rejects_bad_shapes_and_dtypes():
    h, w, b = np.ones((2, 8), np.float32), np.ones((10, 8), np.float32), np.full((2, 1), -1, np.int32)
    with pytest.raises(ValueError, match="must be"):
        greedy_head_cpu(h, np.ones((10, 7), np.float32), b)
    with pytest.raises(ValueError, match="must be"):
        greedy_head_cpu(h, w, np.full((3, 1), -1, np.int32))
    with pytest.raises(ValueError, match="at most"):
        greedy_head_cpu(np.ones((MAX_ROWS + 1, 8), np.float32), w, np.full((MAX_ROWS + 1, 1), -1, np.int32))
    with pytest.raises(ValueError, match="empty vocabulary"):
        greedy_head_cpu(h, np.ones((0, 8), np.float32), b)
    with pytest.raises(ValueError, match="float32"):
        greedy_head_cpu(h.astype(np.float16), w, b)
    with pytest.raises(ValueError, match="int32"):
        greedy_head_cpu(h, w, b.astype(np.int64))


def test_vmap():
    rng = np.random.default_rng(4)
    h = rng.standard_normal((3, 20, 16)).astype(np.float32)
    w = rng.standard_normal((50, 16)).astype(np.float32)
    b = np.full((3, 20, 2), -1, np.int32)
    tokens, logprobs = jax.device_get(jax.vmap(greedy_head_cpu, in_axes=(0, None, 0))(h, w, b))
    for i in range(3):
        want_tokens, want_logprobs = greedy_head_reference(h[i], w, b[i])
        np.testing.assert_array_equal(tokens[i], want_tokens)
        np.testing.assert_allclose(logprobs[i], want_logprobs, rtol=1e-5, atol=1e-5)


def test_the_sampler_executable_takes_the_kernel_for_its_rows():
    """`sample_packed` under `LMHead.greedy_kernel`: the tokens and logprobs of the row-major head for greedy-only
    batches (the kernel from GREEDY_KERNEL_MIN_ROWS rows), and the kernel's custom call in exactly those
    executables; other variants ignore the flag."""
    s, embed, vocab = 64, 32, 1000
    rng = np.random.default_rng(5)
    hidden = jnp.asarray(rng.normal(size=(s, embed)).astype(np.float32))
    weight = jnp.asarray(rng.normal(size=(vocab, embed)).astype(np.float32))
    row_major = LMHead(dtype=np.dtype(np.float32))
    kernel = LMHead(dtype=np.dtype(np.float32), vocab_major_greedy=True, greedy_kernel=True)
    rows = [(SamplingParams(temperature=0.0, min_tokens=3), 0, 0, (7, 11)) for _ in range(40)]
    part = pack_sampling(make_sampling_arrays(rows, s))
    for r in (8, GREEDY_KERNEL_MIN_ROWS, 24, 48, 64):
        for variant in (GREEDY_ONLY, FULL_VARIANT):
            want = jax.device_get(sample_packed_jit(hidden, weight, part, variant=variant, rows=r, head=row_major))
            got = jax.device_get(sample_packed_jit(hidden, weight, part, variant=variant, rows=r, head=kernel))
            np.testing.assert_array_equal(got.token_ids, want.token_ids)
            np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got.top_token_ids, want.top_token_ids)
            hlo = sample_packed_jit.lower(hidden, weight, part, variant=variant, rows=r, head=kernel).as_text()
            assert ("sarathi_greedy_head" in hlo) == (variant == GREEDY_ONLY and r >= GREEDY_KERNEL_MIN_ROWS)


def test_the_engine_uses_the_kernel_only_on_avx512_builds(monkeypatch):
    monkeypatch.setattr(kernel_module, "vector_bits", lambda: 256)
    assert not kernel_module.engine_uses_kernel()
    monkeypatch.setattr(kernel_module, "vector_bits", lambda: 512)
    assert kernel_module.engine_uses_kernel()
