"""Helpers of the sampler tests: the jitted sampler on host rows, and float64 references (imported, not
collected)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sarathi_jax.runner.sample.sampler import SamplerOutput, sample_jit
from sarathi_jax.runner.input_batch import make_sampling_arrays, sampler_variant
from sarathi_jax.runner.sample.inputs import SamplerVariant, padded_bitmask
from sarathi_jax.request.sampling_params import SamplingParams

# A few fixed shapes so that the whole file compiles each sampler variant only a handful of times.
S, V = 16, 64
WIDE_V = 300  # k and nuclei past the "top_k" filter's TOP_K_CANDIDATES (128); not a multiple of 128-token blocks
N_DIST = 2048  # rows (= samples) for the distribution tests


def run(
    logits: np.ndarray, rows: list, max_num_seqs: int | None = None, variant: SamplerVariant | None = None
) -> SamplerOutput:
    """The jitted sampler on these rows, with the variant the host would pick unless one is given (a
    constrained one gets an all-ones token bitmask: no row constrained)."""
    logits = np.asarray(logits, np.float32)
    arrays = make_sampling_arrays(rows, max_num_seqs or logits.shape[0])
    variant = sampler_variant(rows) if variant is None else variant
    bitmask = padded_bitmask(None, logits.shape[0], -(-logits.shape[1] // 32)) if variant.constrained else None
    return jax.tree.map(np.asarray, sample_jit(jnp.asarray(logits), arrays, variant=variant, token_bitmask=bitmask))


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
