"""Out-major projection weights: the layers' matmul kernels stored `[out..., in...]` (HF's own layout) instead
of `[in..., out...]`, on a CPU.

Why: XLA:CPU hands a dot to YNNPACK, which packs the dot's right operand into its tile layout on every call
(it is not a constant: the weights are arguments of the step, and the layer scan slices them). `x [T, in] @ W
[in, out]` puts the weight on the right, so a decode step of a few rows copies every weight before it reads it.
With the weight stored `[out, in]` it can be the left operand, which YNNPACK reads in place:
`(W [out, in] . x^T)^T`, the transpose of the small `[out, T]` result kept apart from the dot by an
optimization barrier (without it XLA folds the transpose into the dot and emits `x @ W^T`, the weight on the
right again). `python -m sarathi_jax.bench.probes.layer_matmul_cost` measured it 1.3-1.8x faster than
`x @ W` over a stack of layers at 4-32 rows, no different at one row (docs/results-cpu.md §11). From
`LEFT_MAX_ROWS` rows on, the weight goes back on the right (`x . W^T`), where the product is compute-bound and
packing is amortised. Float32 steps of at most `skinny_matmul_cpu.MAX_ROWS` rows skip YNNPACK altogether where
the C++ kernel `pallas_kernels/skinny_matmul_cpu.py` is built for AVX-512 (`engine_uses_kernel`): it reads
each weight row in place, once (0.63-0.87x the time of the weight-left dot over the unrolled layers at 1-32
rows, on the 2-core AVX-512 machine).

The engine's checkpoints and the loader keep `[in..., out...]`: a single-device CPU runner moves the loaded
weights once (`families.to_out_major`), GPUs and tensor/pipeline-parallel runs keep the layout they had. The sums are
the same products in another order (float32 rounding apart).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.skinny_matmul_cpu import MAX_ROWS as SKINNY_MAX_ROWS
from pallas_kernels.skinny_matmul_cpu import engine_uses_kernel, skinny_matmul_cpu

# The most rows of a step (its token bucket) that take the weight as the left operand. Over a stack of the 60M
# Llama's layers it led at 4-32 rows, tied at 64 and lost from 256; `x . W^T` tied the in-major `x @ W` at 64-512
# rows (`layer_matmul_cost` and an ad hoc scan of 64-256 rows, a loaded machine).
LEFT_MAX_ROWS = 64


def out_major_product(x: jax.Array, kernel: jax.Array, num_contracting: int, precision: Any) -> jax.Array:
    """`tensordot(x, kernel_in_major, num_contracting)` of `x [T, in...]` and an out-major `kernel [out...,
    in...]`: `[T, out...]`."""
    out_shape = kernel.shape[: kernel.ndim - num_contracting]
    rows = x.shape[0]
    x2 = x.reshape(rows, -1)
    w2 = kernel.reshape(-1, x2.shape[1])  # [out, in]: a free reshape of a row-major array
    contract_in = (((1,), (1,)), ((), ()))
    if rows <= SKINNY_MAX_ROWS and x2.dtype == w2.dtype == jnp.float32 and engine_uses_kernel():
        y = skinny_matmul_cpu(x2, w2)
    elif rows <= LEFT_MAX_ROWS:
        yt = jax.lax.dot_general(w2, x2, contract_in, precision=precision)  # [out, T], the weight on the left
        y = jax.lax.optimization_barrier(yt).T
    else:
        y = jax.lax.dot_general(x2, w2, contract_in, precision=precision)
    return y.reshape(rows, *out_shape)


def use_out_major(platform: str) -> bool:
    """Whether a single-device runner on `platform` stores its projection weights out-major: on a CPU."""
    return platform == "cpu"
