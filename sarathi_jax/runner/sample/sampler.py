"""Device sampler: one jitted, fixed-shape function from logits to next tokens and logprobs (host-side inputs,
`SamplingArrays` and `SamplerVariant`: sarathi_jax/runner/sample/inputs.py, written in sarathi_jax/runner/input_batch.py).

`sample(logits f32[S, V], arrays, variant)` runs after the engine's jitted step; S rows (the step's `step_inputs.sample_rows`), one
per scheduled sequence, the rest padding (temperature < 0: their outputs are meaningless and ignored).

Per non-greedy row: logits / temperature, then the top-k, top-p and min-p masks (vLLM's order and semantics:
top-k keeps every token >= the k-th largest logit, ties kept; top-p keeps the smallest top set whose mass is
>= top_p * total mass of the top-k-renormalised distribution, i.e. `probs >= t` for the largest t with
mass(probs >= t) >= top_p * total; min-p keeps p >= min_p * p_max), then inverse-CDF sampling with one
uniform drawn from `fold_in(PRNGKey(seed), step)`. The key depends only on the request's seed and its number
of generated tokens, and every operation is row-wise, so a seeded request gets the same tokens whatever else
is in the batch and whichever row it lands in (given the same logits).

No data-dependent control flow: on a GPU every `lax.cond` / `while_loop` on a device predicate copies the
predicate to the host, a sync in the middle of each engine step. Work is skipped statically instead:
  * `SamplerVariant` (sampled, filter, logprobs) is chosen on the host from the batch's rows by
    `variant_of` (sarathi_jax/runner/input_batch.py, which writes the `SamplingArrays` too) and passed as a static argument (`sample_jit`); each of the 10 `SAMPLER_VARIANTS` is a
    straight-line program. A variant without a capability is still exact for the rows that do not need it
    (greedy and padding rows of a sampled batch, unfiltered rows of a filtered batch, top-k-only rows with
    k <= 128 under the "top_k" filter), and the host's choice gives bitwise the same tokens and logprobs as
    the most general variant (`FULL_VARIANT`);
  * filter "top_k" (the host sees that every filtering row is top-k only, with k <= TOP_K_CANDIDATES = 128):
    the k-th largest logit is the k-th of one `lax.top_k(masked, 128)`, no radix select; the same kept set
    (ties kept) as the radix top-k;
  * filter "exact": top-k (any k) and top-p (any nucleus size) are a fixed 3-pass radix select (11/11/10
    bits) over order-preserving uint32 keys: the ordered bits of the masked logits for top-k (temperature
    does not change the order), the raw bits of the non-negative probs for top-p. Each pass is one per-row
    histogram over [S, 2048] bins (`segment_sum`: token counts for top-k, probability mass for top-p) of the
    tokens whose higher bits match the prefix chosen so far, a reverse cumsum, and the largest bin whose
    cumulative count / mass (plus what lies above the prefix) still reaches the target. After 3 passes the
    prefix is the exact k-th largest key / largest top-p threshold. Rows that do not ask for a mask get "keep
    all". Top-p masses are float32 sums per bin, so a target within float32 rounding of a cumulative mass may
    put the boundary one token away from a float64 sort (and on a GPU, whose float scatter-add has no fixed
    order, vary between runs); counts (top-k) are exact.

Cost notes (why no sort): a full sort of [128, 32000] costs ~1 s on a 2-core CPU, and Gumbel-max needs
S*V random numbers (~110 ms there). Instead
  * each radix pass is a segment-id computation and one scatter-add over [S, V] (the later passes drop most
    tokens); the "exact" filter always runs all 6 (top-k and top-p), ~60 ms at [128, 32000] on that CPU.
    Top-k-only batches with small k (e.g. top_k=50) take the "top_k" filter instead: one `lax.top_k` of 128
    candidates, ~12 ms there (~3x faster for the whole sampler; ~1.9x at V=128256). Small nuclei get no
    such path: the host cannot know a nucleus' size;
  * sampling draws one uniform per row and inverts the CDF in two levels (block sums of 128 tokens, then the
    chosen block), so no long cumsum and no S*V random numbers; the masked probs are recomputed from the
    logits inside the block sums and for the chosen block instead of being materialised as [S, V];
  * greedy argmax is two-level too (block maxima, then the first max inside the first block holding the row
    max): same first-index-on-ties result as np.argmax, several times faster on XLA:CPU than a variadic
    argmax or a one-level `min(where(x == max, iota, V))`; the top-MAX_LOGPROBS `lax.top_k` only runs in
    variants with `logprobs`. `python -m benchmarks.probes.sampler_cost` times every variant."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from sarathi_jax.runner.sample.inputs import (  # noqa: F401  (the host side, re-exported: callers import it from here)
    FULL_VARIANT,
    MAX_BANNED,
    SAMPLER_FILTERS,
    SAMPLER_VARIANTS,
    SAMPLING_EPS,
    TOP_K_CANDIDATES,
    SamplerVariant,
    SamplingArrays,
    SamplingRow,
)
from sarathi_jax.request.sampling_params import MAX_LOGPROBS
from sarathi_jax.runner.sample.vocab_major import GREEDY_ONLY, greedy_on_cpu
from sarathi_jax.runner.step_inputs import sampling_max_num_seqs, unpack_sampling

if TYPE_CHECKING:
    from sarathi_jax.parallel.stages import LMHead

# Tokens per block of the two-level inverse CDF.
_CDF_BLOCK = 128

# Digit widths of the radix select, most significant first: 32 bits, histograms of at most 2048 bins per row.
_RADIX_BITS = (11, 11, 10)


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; log_softmax(raw logits)[token]
    top_token_ids: jax.Array  # i32[S, MAX_LOGPROBS]; most likely first (lower id first on ties)
    top_logprobs: jax.Array  # f32[S, MAX_LOGPROBS]; -inf (ids 0) in variants without logprobs


# ----------------------------------------------------------------------------------------------- device


def _rowwise(a: jax.Array, x: jax.Array) -> jax.Array:
    """Per-row values a[S] shaped to broadcast against x[S, ...]."""
    return a.reshape(a.shape + (1,) * (x.ndim - 1))


def _blocks(x: jax.Array, width: int) -> tuple[jax.Array, jax.Array | None]:
    """x[S, V] as whole blocks [S, V // width, width] (a free reshape) and the rest padded with -inf to [S, width]
    (None when width divides V): no padded copy of the whole array."""
    s, v = x.shape
    n_full = v // width
    full = x[:, : n_full * width].reshape(s, n_full, width)
    if n_full * width == v:
        return full, None
    return full, jnp.pad(x[:, n_full * width :], ((0, 0), (0, width - (v - n_full * width))), constant_values=-jnp.inf)


def _pick_block(full: jax.Array, tail: jax.Array | None, block: jax.Array) -> jax.Array:
    """Row i's block block[i] of `_blocks`' output: [S, width]."""
    n_full = full.shape[1]
    inner = jnp.take_along_axis(full, jnp.minimum(block, n_full - 1)[:, None, None], axis=1)[:, 0, :]
    return inner if tail is None else jnp.where((block == n_full)[:, None], tail, inner)


def _first_index_of_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(argmax, max) along the last axis of [S, V], first index on ties (== np.argmax for NaN-free rows).

    Two levels, each reading its input once: the maxima of blocks of _CDF_BLOCK tokens, the first block holding
    the row max, then the first index of the max inside that block. One-level `min(where(x == max, iota, V))`
    makes XLA:CPU materialise [S, V] temporaries (~5x slower at V=128256); its variadic argmax is slower still.
    """
    v = x.shape[1]
    width = min(_CDF_BLOCK, v)
    full, tail = _blocks(x, width)
    block_max = jnp.max(full, axis=-1)  # [S, V // width]
    if tail is not None:
        block_max = jnp.concatenate([block_max, jnp.max(tail, axis=-1, keepdims=True)], axis=-1)
    row_max = jnp.max(block_max, axis=-1)
    block = _first_true(block_max == row_max[:, None])
    offset = _first_true(_pick_block(full, tail, block) == row_max[:, None])
    return jnp.minimum(block * width + offset, v - 1), row_max  # all-NaN row: stay in range


def _first_true(cond: jax.Array) -> jax.Array:
    """First index where `cond` holds along the last axis, clipped to the last index if none."""
    n = cond.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, cond.shape, cond.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(cond, iota, n), axis=-1), n - 1)


def _ordered_u32(x: jax.Array) -> jax.Array:
    """Map float32 to uint32 so that unsigned order == float order (radix select on bit patterns)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits >> 31
    return jnp.where(sign == 1, ~bits, bits | jnp.uint32(0x80000000))


def _ordered_f32(key: jax.Array) -> jax.Array:
    """Inverse of `_ordered_u32`."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _radix_select(keys: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the largest uint32 t with sum(weights[keys >= t]) >= target (0 if none), in len(_RADIX_BITS)
    fixed passes.

    keys u32[S, V], weights [S, V] (non-negative: i32 ones for a k-th largest key, f32 probs for a top-p
    threshold), target [S] of the weights' dtype. Each pass histograms the weights of the tokens whose higher
    bits equal the prefix chosen so far by their next digit, and extends the prefix by the largest digit
    whose suffix sum (plus the weight above the prefix) reaches the target. Every row only sees its own
    tokens and bins. Float masses are summed per bin, so a target within rounding of a cumulative mass may
    land one token either side of an exact (float64) sort.
    """
    s, v = keys.shape
    rows = jax.lax.broadcasted_iota(jnp.int32, (s, v), 0)
    prefix = jnp.zeros((s,), jnp.uint32)
    above = jnp.zeros((s,), weights.dtype)  # weight of the tokens above the current prefix range
    shift = 32
    for bits in _RADIX_BITS:
        shift -= bits
        n_bins = 1 << bits
        digit = ((keys >> shift) & jnp.uint32(n_bins - 1)).astype(jnp.int32)
        # Only tokens inside the range chosen so far, and with weight (zero weights change no sum; skipping
        # them is cheaper, e.g. the top-k-masked tokens in top-p); the rest get an out-of-range id: dropped.
        live = weights > 0
        if shift + bits < 32:
            high = shift + bits
            live &= (keys >> high) == (prefix >> high)[:, None]
        segment = jnp.where(live, rows * n_bins + digit, s * n_bins)
        hist = jax.ops.segment_sum(weights.reshape(-1), segment.reshape(-1), num_segments=s * n_bins)
        # at_least[b] = weight of the tokens with key >= prefix | b << shift.
        at_least = above[:, None] + jax.lax.cumsum(hist.reshape(s, n_bins), axis=1, reverse=True)
        iota = jax.lax.broadcasted_iota(jnp.int32, at_least.shape, 1)
        # The largest qualifying digit (a max, not a count: float suffix sums need not be monotone); 0 if none.
        best = jnp.max(jnp.where(at_least >= target[:, None], iota, 0), axis=1)
        next_bin = jnp.minimum(best + 1, n_bins - 1)[:, None]
        above = jnp.where(best < n_bins - 1, jnp.take_along_axis(at_least, next_bin, axis=1)[:, 0], above)
        prefix = prefix | (best.astype(jnp.uint32) << shift)
    return prefix


def _top_k_top_p_thresholds(
    masked: jax.Array, probs: jax.Array, k: jax.Array, top_p: jax.Array, want_top_k: jax.Array, want_top_p: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Exact per-row thresholds (kth f32[S], t f32[S]): the row keeps `masked >= kth` (its top-k, ties with the
    k-th value kept) and, of those, `probs >= t` (the top-p nucleus of the top-k-renormalised distribution).

    `probs` are the unnormalised probs of `masked` (max 1). Rows that do not want a mask get kth = -inf, t = 0.
    """
    # top-k on the masked logits (temperature does not change the order); compared as floats, so every token
    # equal to the k-th value is kept.
    kth = _ordered_f32(_radix_select(_ordered_u32(masked), jnp.ones(masked.shape, jnp.int32), k))
    kth = jnp.where(want_top_k, kth, -jnp.inf)
    probs = jnp.where(masked >= kth[:, None], probs, 0.0)
    # top-p: the largest t with mass(probs >= t) >= top_p * total. Non-negative floats order like their bits;
    # t is some kept token's prob (target > 0), so the max (1) always stays.
    target = top_p * jnp.sum(probs, axis=-1)
    t = _radix_select(jax.lax.bitcast_convert_type(probs, jnp.uint32), probs, target)
    return kth, jnp.where(want_top_p, jax.lax.bitcast_convert_type(t, jnp.float32), 0.0)


def _kth_of_candidates(masked: jax.Array, k: jax.Array, want_top_k: jax.Array) -> jax.Array:
    """Per row, the k-th largest value of `masked` (-inf where not `want_top_k`): the same kept set
    `masked >= kth` as `_top_k_top_p_thresholds`' exact top-k, for k <= TOP_K_CANDIDATES only (a larger k gets
    the TOP_K_CANDIDATES-th value: the host never picks the "top_k" filter for such rows)."""
    n = min(TOP_K_CANDIDATES, masked.shape[1])
    candidates, _ = jax.lax.top_k(masked, n)  # [S, n], largest first
    kth = jnp.take_along_axis(candidates, jnp.clip(k - 1, 0, n - 1)[:, None], axis=1)[:, 0]
    return jnp.where(want_top_k, kth, -jnp.inf)


def inverse_cdf_sample(x: jax.Array, probs_of: Callable[[jax.Array], jax.Array], u: jax.Array) -> jax.Array:
    """Token with P(i) = p[i] / sum(p), p = probs_of(x) (elementwise, per row, probs_of(-inf) == 0), for
    uniforms u in [0, 1), in two levels: block sums of _CDF_BLOCK tokens, then the chosen block.

    p is never materialised: it is recomputed from x inside the block sums and for the chosen block. Never
    returns a zero-probability token (masked, banned): the chosen block and token must have mass > 0, with a
    fallback to the last positive one against rounding at the top end.
    """
    v = x.shape[1]
    width = min(_CDF_BLOCK, v)
    full, tail = _blocks(x, width)
    block_mass = jnp.sum(probs_of(full), axis=-1)  # [S, V // width]
    if tail is not None:
        block_mass = jnp.concatenate([block_mass, jnp.sum(probs_of(tail), axis=-1, keepdims=True)], axis=-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    threshold = u * block_cdf[:, -1]
    b = _first_true_or_last((block_cdf > threshold[:, None]) & (block_mass > 0), block_mass > 0)
    before = jnp.where(b > 0, jnp.take_along_axis(block_cdf, jnp.maximum(b - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = probs_of(_pick_block(full, tail, b))  # [S, width]
    inner_cdf = jnp.cumsum(inner, axis=-1)
    j = _first_true_or_last((inner_cdf > (threshold - before)[:, None]) & (inner > 0), inner > 0)
    return jnp.minimum(b * width + j, v - 1)


def _first_true_or_last(cond: jax.Array, fallback: jax.Array) -> jax.Array:
    """First index where `cond` holds along the last axis, else the last index where `fallback` holds (or 0)."""
    n = cond.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, cond.shape, cond.ndim - 1)
    first = jnp.min(jnp.where(cond, iota, n), axis=-1)
    last = jnp.maximum(jnp.max(jnp.where(fallback, iota, -1), axis=-1), 0)
    return jnp.where(first < n, first, last)


def row_uniforms(keys: jax.Array, steps: jax.Array, stream: int | None = None) -> jax.Array:
    """One uniform per row from fold_in(key, step): the row's sampling uniform; with `stream`, a further
    fold_in of it (speculation's other draws, `rejection_sampling`), independent of the first."""
    def one(key_data: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), step)
        return jax.random.uniform(key if stream is None else jax.random.fold_in(key, stream), (), jnp.float32)

    return jax.vmap(one)(keys, steps)


def filtered_probs_of(masked: jax.Array, masked_max: jax.Array, arrays: SamplingArrays, sampled: jax.Array,
                      filter_: str) -> Callable[[jax.Array], jax.Array]:
    """Temperature, top-k and top-p (as `filter_` allows: a `SamplerVariant.filter`), min-p: the function from
    logits to the row's unnormalised kept probs (elementwise per row, max 1), meaningful where `sampled`."""
    s, v = masked.shape
    inv_t = jnp.where(sampled, 1.0 / jnp.where(sampled, arrays.temperature, 1.0), 1.0)

    def unnormalised(x: jax.Array) -> jax.Array:
        # Probabilities of logits / T with the max at 1 (T > 0 keeps the argmax).
        return jnp.exp((x - _rowwise(masked_max, x)) * _rowwise(inv_t, x))

    # min-p: p_i >= min_p * p_max, and p_max == 1 here (top-k/top-p always keep the max); top-p's threshold
    # folds into the same compare.
    threshold = arrays.min_p
    kth = None
    want_top_k = sampled & (arrays.top_k > 0) & (arrays.top_k < v)
    if filter_ == "top_k":  # every top_p == 1 (no top-p) and every k <= TOP_K_CANDIDATES
        kth = _kth_of_candidates(masked, arrays.top_k, want_top_k)
    elif filter_ == "exact":
        want_top_p = sampled & (arrays.top_p < 1.0)
        kth, t = _top_k_top_p_thresholds(
            masked, unnormalised(masked), arrays.top_k, arrays.top_p, want_top_k, want_top_p
        )
        threshold = jnp.maximum(threshold, t)

    def probs_of(x: jax.Array) -> jax.Array:
        # Recomputed per block: the same elementwise ops on the same logits give the same bits as the probs
        # the thresholds were selected from.
        p = unnormalised(x)
        keep = p >= _rowwise(threshold, x)
        if kth is not None:
            keep &= x >= _rowwise(kth, x)
        return jnp.where(keep, p, 0.0)

    return probs_of


def mask_banned(logits: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """float32 logits with each row's banned ids at -inf (scattered into a copy: cheaper than an [S, V] mask;
    -1 pads are pushed out of range and dropped)."""
    logits = logits.astype(jnp.float32)
    rows = jax.lax.broadcasted_iota(jnp.int32, arrays.banned_token_ids.shape, 0)
    banned_ids = jnp.where(arrays.banned_token_ids < 0, logits.shape[1], arrays.banned_token_ids)
    return logits.at[rows, banned_ids].set(-jnp.inf, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [R, V] with the tokens whose bit is 0 in bitmask int32 [R, ceil(V/32)] set to -inf (bit t % 32
    of word t // 32 is token t; `structured_outputs.GrammarMatcher.fill_bitmask` writes the rows). An all-ones
    row (-1 words) leaves its logits as they are."""
    rows, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.uint32)
    words = jax.lax.bitcast_convert_type(bitmask, jnp.uint32)
    bits = (words[:, :, None] >> shifts) & jnp.uint32(1)
    allowed = bits.reshape(rows, -1)[:, :vocab].astype(jnp.bool_)
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))


def sample(logits: jax.Array, arrays: SamplingArrays, variant: SamplerVariant = FULL_VARIANT,
           token_bitmask: jax.Array | None = None) -> SamplerOutput:
    """Next token per row, its logprob and the top-MAX_LOGPROBS logprobs (of the raw logits, but for a
    constrained variant's `token_bitmask`: applied first, as vLLM does, so a constrained row's logprobs are
    over the tokens its grammar allows).

    Jittable with `variant` static (see `sample_jit`): straight-line array ops for every variant.
    """
    logits = logits.astype(jnp.float32)
    if variant.constrained:
        logits = apply_token_bitmask(logits, token_bitmask)
    s, v = logits.shape
    sampled = arrays.temperature >= SAMPLING_EPS  # greedy: [0, SAMPLING_EPS); padding (< 0): neither

    masked = mask_banned(logits, arrays)
    # Always computed: greedy rows may sit in any batch, and it is the fallback of all-banned sampled rows.
    token_ids, masked_max = _first_index_of_max(masked)
    if variant.sampled:
        probs_of = filtered_probs_of(masked, masked_max, arrays, sampled, variant.filter)
        sampled_tokens = inverse_cdf_sample(masked, probs_of, row_uniforms(arrays.keys, arrays.steps))
        # A row whose every token is banned has no finite max: keep the greedy pick (in range).
        token_ids = jnp.where(sampled & jnp.isfinite(masked_max), sampled_tokens, token_ids)
    token_ids = token_ids.astype(jnp.int32)

    # Logprobs of the raw logits (no temperature, no masks), as vLLM reports them.
    lse = jax.nn.logsumexp(logits, axis=-1)
    token_logprobs = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0] - lse
    n_top = min(MAX_LOGPROBS, v)
    if variant.logprobs:
        top_logits, top_ids = jax.lax.top_k(logits, n_top)
        top_ids, top_logprobs = top_ids.astype(jnp.int32), top_logits - lse[:, None]
    else:
        top_ids = jnp.zeros((s, n_top), jnp.int32)
        top_logprobs = jnp.full((s, n_top), -jnp.inf, jnp.float32)
    if n_top < MAX_LOGPROBS:  # tiny vocabularies (tests): pad to the fixed width
        pad = ((0, 0), (0, MAX_LOGPROBS - n_top))
        top_ids = jnp.pad(top_ids, pad)
        top_logprobs = jnp.pad(top_logprobs, pad, constant_values=-jnp.inf)
    return SamplerOutput(token_ids, token_logprobs, top_ids, top_logprobs)


# The jitted sampler for callers outside a jitted step, module-level so that every engine in the process
# shares one compilation cache (one compile per shape and variant).
sample_jit = jax.jit(sample, static_argnames=("variant",))


def sample_packed(hidden: jax.Array, head_weight: jax.Array, sampling: jax.Array, token_bitmask: jax.Array | None = None,
                  *, variant: SamplerVariant, rows: int, head: LMHead) -> SamplerOutput:
    """A step's sampler executable: the LM head on the first `rows` (R, `sample_rows`) of the last stage's final-normed rows [S, embed],
    then the sampler on those logits [R, vocab] with the first R rows of the sampling part (laid out for S =
    max_num_seqs rows). The token ids come back padded to [S] (the next step reads pending tokens from them
    whatever its own bucket). `token_bitmask` [S, ceil(V/32)]: constrained variants only. A greedy-only batch
    on a CPU may take one of `sampling_vocab_major`'s forms instead (`greedy_on_cpu`)."""
    s = sampling_max_num_seqs(sampling.shape[0])
    arrays = unpack_sampling(sampling, s, rows)
    greedy = greedy_on_cpu(hidden, head_weight, arrays, rows=rows, head=head) if variant == GREEDY_ONLY else None
    if greedy is not None:
        out = SamplerOutput(*greedy, jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
                            jnp.full((rows, MAX_LOGPROBS), -jnp.inf, jnp.float32))
    else:
        mask = token_bitmask[:rows] if variant.constrained else None
        out = sample(head.logits(hidden[:rows], head_weight), arrays, variant, mask)
    return head.replicate(out._replace(token_ids=jnp.pad(out.token_ids, (0, s - rows))))


# Module level: engines with the same shapes share the compiled sampler variants.
sample_packed_jit = jax.jit(sample_packed, static_argnames=("variant", "rows", "head"))


@functools.partial(jax.jit, static_argnames=("rows", "head"))
def captured_logits(hidden: jax.Array, head_weight: jax.Array, *, rows: int, head: LMHead) -> jax.Array:
    """The logits the sampler sampled (`ModelRunner.capture_logits`): the same head on the same rows."""
    return head.logits(hidden[:rows], head_weight)
