"""The greedy-only sampler on a CPU: what `sampling.sample` computes for the `GREEDY_ONLY` variant (no sampled
row, no logprobs, no constraint), in the two forms `sampling.sample_packed` takes there (`greedy_on_cpu`).

* **The C++ kernel** (`pallas_kernels.greedy_head_cpu`, where `LMHead.greedy_kernel` is set: a single CPU device,
  float32, the kernel built for AVX-512), for `GREEDY_KERNEL_MIN_ROWS..GREEDY_KERNEL_MAX_ROWS` rows: the LM
  head and the sampler in one pass, no logits written. On the 60M Llama's head ([32000, 512]) it took 0.6-0.85x
  the time of the jnp forms below at 16-64 rows, tied at 8 and lost at 1-4, where it reads the head slower
  than XLA's dot does.
* **Vocab-major logits** `[vocab, R]`, every reduction over axis 0 (`greedy_vocab_major`), for at most
  `MAX_ROWS` rows where `LMHead.vocab_major_greedy` is set (on a CPU). Why a second layout: XLA:CPU's YNNPACK
  packs a dot's right operand on every call. Logits `[R, vocab]` put the head's weight on the right, so each
  step repacks it (a copy of the whole head); `[vocab, R]` = weight `[vocab, embed]` x rows^T puts it on the
  left, where it is read in place. Greedy sampling only reduces over the vocabulary (banned ids, first index of
  the max, the chosen token's logprob), so it can work on that layout directly; transposing back to
  `[R, vocab]` would give the gain away (XLA then emits the dot in the other order).

Both give the same tokens as `sample` on the same logits (first index on ties, all-banned rows -> 0, NaN rows ->
the last id) and logprobs equal to float32 rounding (the sums run in another order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from pallas_kernels.greedy_head_cpu import MAX_ROWS as GREEDY_KERNEL_MAX_ROWS, greedy_head_cpu
from sarathi_jax.runner.sample.inputs import SamplerVariant, SamplingArrays

if TYPE_CHECKING:
    from sarathi_jax.parallel.stages import LMHead

# The one variant this path serves.
GREEDY_ONLY = SamplerVariant(sampled=False, filter="none", logprobs=False)

# The most rows it serves: from 64 rows the dot is compute-bound enough that YNNPACK's packing no longer
# dominates, and the [vocab, R] reductions were slower (`sampler_cost --head`: 0.65-0.8x at 64-128 rows,
# 1.1-2.5x at 4-32, on a loaded 2-core machine).
MAX_ROWS = 32

# The fewest rows the C++ kernel serves (see the module docstring): at 16 rows it took 0.74-0.85x the time of the
# vocab-major form, at 8 it tied, at 1-4 it lost on SmolLM2's head.
GREEDY_KERNEL_MIN_ROWS = 9


def greedy_vocab_major(logits_t: jax.Array, arrays: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """(token ids i32[R], their logprobs f32[R]) of vocab-major float32 logits `[vocab, R]`: the argmax of
    each column with its banned ids (`arrays.banned_token_ids [R, MAX_BANNED]`, -1 padded) set to -inf, and
    log_softmax(raw column)[token]."""
    v = logits_t.shape[0]
    cols = jax.lax.broadcasted_iota(jnp.int32, arrays.banned_token_ids.shape, 0)
    banned_ids = jnp.where(arrays.banned_token_ids < 0, v, arrays.banned_token_ids)  # -1 pads -> dropped
    masked = logits_t.at[banned_ids, cols].set(-jnp.inf, mode="drop")
    column_max = jnp.max(masked, axis=0)
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, masked.shape, 0)
    # First index of the max; a NaN column matches nowhere and takes the last id, as `sample` does.
    token_ids = jnp.minimum(jnp.min(jnp.where(masked == column_max[None, :], vocab_ids, v), axis=0), v - 1)
    lse = jax.nn.logsumexp(logits_t, axis=0)
    token_logprobs = jnp.take_along_axis(logits_t, token_ids[None, :], axis=0)[0] - lse
    return token_ids.astype(jnp.int32), token_logprobs


def greedy_on_cpu(hidden: jax.Array, head_weight: jax.Array, arrays: SamplingArrays, *, rows: int,
                  head: LMHead) -> tuple[jax.Array, jax.Array] | None:
    """(token ids i32[R], their logprobs f32[R]) of the greedy-only sampler on `hidden[:rows]` [R, embed] by one
    of this module's forms, or None where neither serves `rows` under `head` (`sample` on row-major logits
    then)."""
    if head.greedy_kernel and GREEDY_KERNEL_MIN_ROWS <= rows <= GREEDY_KERNEL_MAX_ROWS:
        return greedy_head_cpu(hidden[:rows], head_weight, arrays.banned_token_ids)
    if head.vocab_major_greedy and rows <= MAX_ROWS:
        return greedy_vocab_major(head.logits_vocab_major(hidden[:rows], head_weight), arrays)
    return None
