"""Rejection sampling of speculative drafts (Leviathan et al. 2023; Chen et al. 2023): the device side, and why
the n-gram path needs no more than the sampler it already runs.

**The general step** (`rejection_sample`, one verification position per row). A proposer drew draft token d
from its distribution q; the target's processed distribution at that position is p (temperature, top-k,
top-p, min-p, bans applied, normalised). Accept d with probability min(1, p(d) / q(d)); on rejection, sample
from the residual norm(max(p - q, 0)). The token is then distributed exactly as p, and P(accept) =
sum_t min(p(t), q(t)), the most any scheme emitting d can accept. The caller walks a sequence's positions in
order and stops at the first rejection; after k accepted drafts, the bonus token is a plain sample of p at the
last position. A rejected row's token is never d (rejection needs p(d) < q(d), so the residual is 0 at d):
"accepted iff token == draft" holds, which is how `speculative.emitted_rows` reads verification rows.

**Point-mass drafts** (prompt lookup: q = onehot(d)). The step reduces to: accept with probability p(d),
else sample p with d removed and renormalised. The engine implements it without a second uniform: each
verification row samples the target's own token y from p with the uniform of that position's step
(`sampling.sample`, key fold_in(PRNGKey(seed), step), as a non-speculative step would), and d is accepted iff
y == d. Then P(accept) = P(y = d) = p(d), and given a rejection y is p conditioned on y != d: the residual. So
the emitted tokens are distributed as the rejection sampler's, with its acceptance rate, and are moreover the
very tokens the non-speculative run samples with the same seed, whatever k the budget granted and whatever
shares the batch (up to float rounding between a chunk's logits and a decode's, as for greedy near-ties).
That coupling needs q to be a point mass: for a draft drawn from a dense q (a draft model), comparing an
independent target sample with it is still exact but accepts only sum_t p(t) q(t); use `rejection_sample`.

**Sampled drafts** (a draft model, "self" or "model", on a sampled request: `draft_runner`). The draft samples
each token from its own q, its logits processed as the target's are (`sampling.filtered_probs_of`: the
request's temperature, top-k, top-p, min-p, min_tokens bans; `draft_sample`), with the uniform of stream
DRAFT_STREAM of the request's (seed, step): reproducible, and independent of the target's draws. q's rows stay
on the device; the verification step then replaces each such row's plain sample by `rejection_sample`'s token
(`verify_sampled_drafts`: accept and residual uniforms from streams ACCEPT_STREAM and RESIDUAL_STREAM). Greedy
requests keep the argmax proposal (exact, unchanged). Unlike the point-mass coupling, the emitted tokens are
not the non-speculative run's (they depend on the k the budget grants), only distributed as they are.

Straight-line array ops (no cond / while: no host sync on a GPU), fixed shapes, jittable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from sarathi_jax.runner.sample.sampler import filtered_probs_of, inverse_cdf_sample, mask_banned, row_uniforms
from sarathi_jax.runner.sample.inputs import SAMPLING_EPS, SamplingArrays
from sarathi_jax.runner.step_inputs import sampling_max_num_seqs, unpack_sampling

if TYPE_CHECKING:
    from sarathi_jax.parallel.stages import LMHead

# fold_in tags of a sampled draft's uniforms on top of the row's (seed, step) key: each draw its own stream.
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 1, 2, 3


def rejection_sample(
    target_probs: jax.Array,
    draft_probs: jax.Array,
    draft_token_ids: jax.Array,
    accept_uniforms: jax.Array,
    residual_uniforms: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One rejection-sampling step per row: (token ids i32[R], accepted bool[R]).

    target_probs, draft_probs f32[R, V]: p and q, each row normalised (q(d) > 0: d was drawn from q);
    draft_token_ids i32[R]; accept_uniforms, residual_uniforms f32[R] in [0, 1), independent. The token is d
    where accepted, else a sample of norm(max(p - q, 0)).
    """
    p, q = target_probs.astype(jnp.float32), draft_probs.astype(jnp.float32)
    d = draft_token_ids.astype(jnp.int32)[:, None]
    p_d = jnp.take_along_axis(p, d, axis=1)[:, 0]
    q_d = jnp.take_along_axis(q, d, axis=1)[:, 0]
    accepted = accept_uniforms * q_d < p_d  # u < p(d) / q(d), without dividing by a tiny q(d)
    residual = jnp.maximum(p - q, 0.0)
    # inverse_cdf_sample pads the vocabulary's last block with -inf: those weigh 0.
    resampled = inverse_cdf_sample(residual, lambda x: jnp.maximum(x, 0.0), residual_uniforms)
    # An empty residual means p == q: then every draft is accepted (rounding aside: keep d).
    keep_draft = accepted | (jnp.sum(residual, axis=-1) <= 0.0)
    return jnp.where(keep_draft, d[:, 0], resampled).astype(jnp.int32), accepted


rejection_sample_jit = jax.jit(rejection_sample)


def _processed(logits: jax.Array, arrays: SamplingArrays, filter_: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(masked logits, their row max, normalised processed probs [R, V]); the probs are meaningful for sampled
    rows with a finite max (some token not banned)."""
    masked = mask_banned(logits, arrays)
    masked_max = jnp.max(masked, axis=-1)
    probs_of = filtered_probs_of(masked, masked_max, arrays, arrays.temperature >= SAMPLING_EPS, filter_)
    probs = probs_of(masked)
    return masked, masked_max, probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)


def draft_sample(logits: jax.Array, arrays: SamplingArrays, filter_: str) -> tuple[jax.Array, jax.Array]:
    """A draft step's tokens i32[S] and its q f32[S, V]: sampled rows draw from their processed distribution
    (`filter_` a `SamplerVariant.filter` that serves the rows) with DRAFT_STREAM's uniform; greedy and padding
    rows (and rows with every token banned) take the argmax, their q meaningless."""
    masked, masked_max, q = _processed(logits, arrays, filter_)
    sampled = (arrays.temperature >= SAMPLING_EPS) & jnp.isfinite(masked_max)
    # The same unnormalised probs q was normalised from: the token is a draw of q exactly.
    probs_of = filtered_probs_of(masked, masked_max, arrays, sampled, filter_)
    tokens = inverse_cdf_sample(masked, probs_of, row_uniforms(arrays.keys, arrays.steps, DRAFT_STREAM))
    return jnp.where(sampled, tokens, jnp.argmax(logits, axis=-1)).astype(jnp.int32), q


def verify_sampled_drafts(hidden: jax.Array, head_weight: jax.Array, sampling: jax.Array, token_ids: jax.Array,
                          logprobs: jax.Array, draft_probs: tuple[jax.Array, ...], q_index: jax.Array,
                          draft_token_ids: jax.Array, *, rows: int, head: LMHead, filter_: str
                          ) -> tuple[jax.Array, jax.Array]:
    """A verification step's (token ids i32[S], logprobs f32[R]) with each sampled draft's row (q_index >= 0:
    draft step j = q_index // S, draft row q_index % S of `draft_probs`) replaced by `rejection_sample`'s
    token for its draft, p the target's processed distribution at that row; the other rows as sampled.
    hidden, head_weight, sampling, rows, head: as the step's sampler took them (`sampling.sample_packed`)."""
    s = sampling_max_num_seqs(sampling.shape[0])
    arrays = unpack_sampling(sampling, s, rows)
    logits = head.logits(hidden[:rows], head_weight)
    _, masked_max, p = _processed(logits, arrays, filter_)
    index = q_index[:rows]
    step, row = jnp.clip(index // s, 0, len(draft_probs) - 1), jnp.clip(index % s, 0, s - 1)
    q = draft_probs[0][row]
    for j, probs in enumerate(draft_probs[1:], 1):
        q = jnp.where((step == j)[:, None], probs[row], q)
    tokens, _ = rejection_sample(p, q, draft_token_ids[:rows], row_uniforms(arrays.keys, arrays.steps, ACCEPT_STREAM),
                                 row_uniforms(arrays.keys, arrays.steps, RESIDUAL_STREAM))
    use = (index >= 0) & (arrays.temperature >= SAMPLING_EPS) & jnp.isfinite(masked_max)
    tokens = jnp.where(use, tokens, token_ids[:rows])
    token_logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
    # Replicated under TP, as the sampler's outputs (the next step reads the tokens as it reads the sampler's).
    return head.replicate((token_ids.at[:rows].set(tokens), jnp.where(use, token_logprobs, logprobs)))


verify_sampled_drafts_jit = jax.jit(verify_sampled_drafts, static_argnames=("rows", "head", "filter_"))
