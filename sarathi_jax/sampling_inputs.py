"""The sampler's host side: each step's per-row sampling settings and the compiled variant that serves them.

`make_sampling_arrays(rows, max_num_seqs)` turns the scheduled rows' `SamplingParams`, seeds and steps into the
fixed-shape `SamplingArrays` that `sampling.sample` takes (rows past the batch are padding), and
`sampler_variant(rows)` picks the cheapest `SamplerVariant` (sampled, filter, logprobs) that is exact for those
rows: a static argument of `sampling.sample_jit`, so the device program holds no data-dependent control flow.
Each of the 8 `SAMPLER_VARIANTS` is compiled at warm-up; `FULL_VARIANT` serves any batch. Plain numpy: no
device work happens here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from sarathi_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    import jax

# Width of the per-row banned-token table (EOS + stop_token_ids suppressed before min_tokens outputs).
# A request whose banned set is larger cannot be served: the engine must reject it at validation
# (`make_sampling_arrays` raises ValueError as a last line of defence).
MAX_BANNED = 16

# Temperatures below this are treated as greedy (as vLLM does): dividing by ~0 would overflow.
SAMPLING_EPS = 1e-5

# Candidates of the "top_k" filter: rows with 0 < k <= this take the k-th of one lax.top_k of this many.
TOP_K_CANDIDATES = 128

# Filters of a `SamplerVariant`, least to most general: each serves every batch the ones before it serve.
SAMPLER_FILTERS = ("none", "top_k", "exact")

_U32_MASK = 0xFFFFFFFF
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = np.uint32(0x1BD11BDA)


def _threefry2x32(k1: np.ndarray, k2: np.ndarray, x1: np.ndarray, x2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32 with 20 rounds (Salmon et al., SC'11), elementwise over uint32 arrays: the hash behind
    `jax.random`'s threefry keys (uint32 arithmetic wraps, as it does there). In place on fresh copies: the
    cost is numpy's per-call overhead (~200 calls), not the row count."""
    ks = (k1, k2, k1 ^ k2 ^ _THREEFRY_PARITY)
    x1, x2 = x1 + ks[0], x2 + ks[1]
    high = np.empty_like(x2)
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x1 += x2
            np.left_shift(x2, r, out=high)  # x2 = x1 ^ rotate_left(x2, r)
            x2 >>= 32 - r
            x2 |= high
            x2 ^= x1
        x1 += ks[(i + 1) % 3]
        x2 += ks[(i + 2) % 3]
        x2 += np.uint32(i + 1)
    return x1, x2


def row_uniforms(seeds: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """f32 uniforms in [0, 1), one per (seed, step): bitwise
    `jax.random.uniform(jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), step))` (seed taken
    modulo 2**64, step modulo 2**32; JAX's default partitionable threefry), computed on the host.

    Why on the host: the draw depends only on the request's seed and its number of generated tokens, so the
    sampler takes it as an input, and the device program holds no threefry (whose XLA:CPU compile cost
    about a second in each of the six sampled variants)."""
    seeds_u64 = np.fromiter((int(seed) & 0xFFFFFFFFFFFFFFFF for seed in seeds), np.uint64, len(seeds))
    key_hi = (seeds_u64 >> np.uint64(32)).astype(np.uint32)
    key_lo = (seeds_u64 & np.uint64(_U32_MASK)).astype(np.uint32)
    zeros = np.zeros(len(seeds_u64), np.uint32)
    step_ids = np.fromiter((int(step) & _U32_MASK for step in steps), np.uint32, len(steps))
    k1, k2 = _threefry2x32(key_hi, key_lo, zeros, step_ids)  # fold_in(key, step)
    b1, b2 = _threefry2x32(k1, k2, zeros, zeros)  # 32 random bits: counter 0, halves xor-ed
    mantissa = ((b1 ^ b2) >> np.uint32(9)) | np.uint32(0x3F800000)  # a float in [1, 2)
    return mantissa.view(np.float32) - np.float32(1.0)


class SamplingArrays(NamedTuple):
    """Per-row sampling settings, built on the host each step by `make_sampling_arrays` (a pytree)."""

    temperature: jax.Array  # f32[S]; [0, SAMPLING_EPS) greedy; < 0 padding (no work, output meaningless)
    top_k: jax.Array  # i32[S]; <= 0 or >= V means off
    top_p: jax.Array  # f32[S]; 1.0 means off
    min_p: jax.Array  # f32[S]; 0.0 means off
    uniforms: jax.Array  # f32[S] in [0, 1); the row's one draw, `row_uniforms(seed, step)` (0 where unsampled)
    banned_token_ids: jax.Array  # i32[S, MAX_BANNED]; -1 padded; these ids get -inf (greedy rows too)
    num_logprobs: jax.Array  # i32[S]; top-N logprobs wanted (0 if none); unused on device (the variant decides)


SamplingRow = tuple[SamplingParams, int, int, Sequence[int]]  # (params, seed, step, banned ids)


def make_sampling_arrays(rows: Sequence[SamplingRow], max_num_seqs: int) -> SamplingArrays:
    """Host-side numpy arrays for `sample`; rows past len(rows) are padding (temperature -1: no work, ignored).

    rows[i] = (params, seed, step, banned): `seed` is the request's seed (the engine draws one for unseeded
    requests at admission, so that a preempted-and-recomputed request resamples the same tokens), `step` its
    number of already generated tokens, `banned` the token ids to suppress this step (at most MAX_BANNED).
    """
    n = len(rows)
    if n > max_num_seqs:
        raise ValueError(f"{n} sampling rows exceed max_num_seqs={max_num_seqs}")
    temperature = np.full(max_num_seqs, -1.0, np.float32)
    top_k = np.zeros(max_num_seqs, np.int32)
    top_p = np.ones(max_num_seqs, np.float32)
    min_p = np.zeros(max_num_seqs, np.float32)
    uniforms = np.zeros(max_num_seqs, np.float32)
    banned_ids = np.full((max_num_seqs, MAX_BANNED), -1, np.int32)
    num_logprobs = np.zeros(max_num_seqs, np.int32)
    if n:
        # Column-wise list comprehensions + one numpy conversion each: ~4x cheaper than per-element stores.
        params = [row[0] for row in rows]
        temperature[:n] = [p.temperature if p.temperature >= SAMPLING_EPS else 0.0 for p in params]
        top_k[:n] = [min(p.top_k, 2**31 - 1) if p.top_k > 0 else 0 for p in params]  # >= V is "off" anyway
        top_p[:n] = [p.top_p for p in params]
        min_p[:n] = [p.min_p for p in params]
        sampled = np.flatnonzero(temperature[:n] >= SAMPLING_EPS)
        if sampled.size:  # greedy rows draw nothing (the common all-greedy batch pays no hashing)
            uniforms[sampled] = row_uniforms([rows[i][1] for i in sampled], [rows[i][2] for i in sampled])
        num_logprobs[:n] = [p.logprobs or 0 for p in params]
        for i, row in enumerate(rows):
            banned = row[3]
            if banned:
                if len(banned) > MAX_BANNED:
                    raise ValueError(f"stop_token_ids: at most {MAX_BANNED} ids can be suppressed, got {len(banned)}")
                banned_ids[i, : len(banned)] = banned
    return SamplingArrays(temperature, top_k, top_p, min_p, uniforms, banned_ids, num_logprobs)


@dataclasses.dataclass(frozen=True)
class SamplerVariant:
    """Which optional work `sample` compiles in (a static, hashable jit argument); see `sampler_variant`."""

    sampled: bool = True  # some row has temperature >= SAMPLING_EPS; else greedy only, no sampling work
    # One of SAMPLER_FILTERS; not "none" needs `sampled`. "none": no sampled row sets top_k > 0 or top_p < 1;
    # "top_k": those that do all have top_p == 1 and top_k <= TOP_K_CANDIDATES (one lax.top_k);
    # "exact": any top-k and top-p (radix selects).
    filter: str = "exact"
    logprobs: bool = True  # some row asked for top-N logprobs; else the top arrays are zeros / -inf

    def __post_init__(self) -> None:
        if self.filter not in SAMPLER_FILTERS:
            raise ValueError(f"SamplerVariant: filter must be one of {SAMPLER_FILTERS}, got {self.filter!r}")
        if self.filter != "none" and not self.sampled:
            raise ValueError("SamplerVariant: a filter requires sampled (greedy rows are never filtered)")


# Every valid variant; the last, FULL_VARIANT, serves any batch.
SAMPLER_VARIANTS: tuple[SamplerVariant, ...] = tuple(
    SamplerVariant(sampled, filter_, logprobs)
    for sampled in (False, True)
    for filter_ in (SAMPLER_FILTERS if sampled else ("none",))
    for logprobs in (False, True)
)
FULL_VARIANT = SamplerVariant(sampled=True, filter="exact", logprobs=True)


def sampler_variant(rows: Sequence[SamplingRow]) -> SamplerVariant:
    """The cheapest variant that is exact for these rows (the same rows `make_sampling_arrays` takes).

    Mirrors the device's per-row tests: sampled iff temperature >= SAMPLING_EPS; of the sampled rows, filter
    "exact" if one has top_p < 1 or top_k > TOP_K_CANDIDATES, else "top_k" if one has top_k > 0, else "none"
    (k >= V is "off" on device, which the host cannot see: it only costs time); logprobs iff some row asked
    for N > 0 (the sampled token's own logprob is always computed).
    """
    sampled = top_k = exact = logprobs = False
    for row in rows:
        params = row[0]
        if params.temperature >= SAMPLING_EPS:
            sampled = True
            top_k = top_k or params.top_k > 0
            exact = exact or params.top_p < 1.0 or params.top_k > TOP_K_CANDIDATES
        logprobs = logprobs or (params.logprobs or 0) > 0
    return SamplerVariant(sampled, "exact" if exact else "top_k" if top_k else "none", logprobs)
