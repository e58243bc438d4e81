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

Straight-line array ops (no cond / while: no host sync on a GPU), fixed shapes, jittable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sarathi_jax.sampling import inverse_cdf_sample


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
