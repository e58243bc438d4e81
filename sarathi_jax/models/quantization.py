"""Weight quantization of the decoder layers' projections (W8A16): 8-bit weights, one float32 scale per output
channel, activations in the model dtype.

    q, scale = quantize_kernel(w, in_axes, "int8")   # w [in..., out...] -> q (w's shape, int8), scale [out...]
    w_hat = dequantize_kernel(q, scale, in_axes)     # q * scale, float32: the weights the model computes with

    int8   scale = max|w| / 127 over each output channel's inputs, q = round half to even(w / scale)
    fp8    scale = max|w| / 448 (float8_e4m3fn's largest finite value), q = float8_e4m3fn(w / scale), rounded to
           nearest even; GPUs with FP8 matmul only (`check_supported`)

A channel of zeros has scale 0 and q 0. numpy (host) and jitted (devices) give the same q and scales, bit for bit.
Every `layers.Projection` of a decoder layer is quantized (q, k, v, o, gate, up, down; Falcon's query_key_value,
dense, dense_h_to_4h, dense_4h_to_h): its `kernel` leaf holds q and a `kernel_scale` leaf beside it the scales,
whose logical axes are the kernel's output axes, so tensor parallelism shards the scales with their channels.
Embeddings, norms, biases and the LM head stay in the model dtype. The product is `(x . q) * scale` with q widened
to the activation dtype: per output channel the same sum as `x . (q * scale)`, so a float32 engine equals a float32
forward on the dequantized weights up to float rounding.

`ModelConfig.quantization` selects it; the loaders quantize the float weights of any checkpoint as they read them
(`quantize_kernel` on the host, tensor by tensor; `quantize_tree` on the devices for drawn or restored trees: the
same q and scales bit for bit), and a folder converted with `checkpoints_convert --quantization int8` holds q and
the scales themselves.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sarathi_jax.models.config import QUANTIZATIONS, check_quantization

__all__ = ["QUANTIZATIONS", "KERNEL_SCALE", "check_quantization", "check_supported", "contracting_axes",
           "dequantize_kernel", "fp8_support", "quantize_kernel", "quantize_tree", "storage_dtype"]

# The leaf beside a quantized projection's `kernel` that holds its per-output-channel scales.
KERNEL_SCALE = "kernel_scale"
# Each method's storage dtype and the largest magnitude it holds (what max|w| maps to).
_STORAGE = {"int8": (np.dtype(np.int8), 127.0), "fp8": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0)}


def storage_dtype(quantization: str | None, dtype: Any) -> np.dtype:
    """The dtype a projection kernel is stored in: the method's 8-bit type, or the model `dtype` (None)."""
    return jnp.dtype(dtype) if quantization is None else _STORAGE[quantization][0]


def fp8_support(devices: Sequence[Any]) -> str | None:
    """None where every device has FP8 matmul (an NVIDIA GPU of compute capability 8.9 or later: Ada, Hopper,
    Blackwell), else why not."""
    for device in devices:
        if device.platform != "gpu":
            return (f"FP8 weights need GPUs with FP8 matmul (compute capability 8.9+: H100, L40S); this engine "
                    f"runs on {device.platform!r}")
        capability = getattr(device, "compute_capability", None)
        try:
            major, minor = (int(part) for part in str(capability).split(".")[:2])
        except ValueError:
            return f"FP8 weights need compute capability 8.9+; {device.device_kind} reports {capability!r}"
        if (major, minor) < (8, 9):
            return f"FP8 weights need compute capability 8.9+ (H100, L40S); {device.device_kind} has {capability}"
    return None


def check_supported(quantization: str | None, devices: Sequence[Any]) -> None:
    """ValueError when `quantization` cannot run on `devices` (fp8 off FP8-capable GPUs), naming the reason."""
    check_quantization(quantization)
    if quantization == "fp8":
        why = fp8_support(devices)
        if why is not None:
            raise ValueError(f"quantization='fp8': {why}; use quantization='int8', which runs everywhere")


def contracting_axes(kernel_axes: Sequence[str | None], scale_axes: Sequence[str | None]) -> tuple[int, ...]:
    """Positions of a kernel's input axes: its logical axes that its scale (the output axes, and a stacked
    `layers` axis) does not have."""
    kept = set(scale_axes)
    return tuple(i for i, name in enumerate(kernel_axes) if name not in kept)


def quantize_kernel(w: Any, in_axes: Sequence[int], quantization: str) -> tuple[Any, Any]:
    """`(q, scale)` of a float kernel `w` whose input (contracting) axes are `in_axes`: q of `w`'s shape in the
    method's dtype, scale float32 of `w`'s shape without `in_axes`. numpy in, numpy out (host); a jax array in,
    jax arrays out (traceable)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    dtype, qmax = _STORAGE[quantization]
    w32 = w.astype(xp.float32)
    amax = xp.max(xp.abs(w32), axis=tuple(in_axes), keepdims=True)
    scale = amax / _elementwise(xp.float32(qmax), amax)
    scaled = w32 / _elementwise(xp.where(scale == 0, xp.float32(1), scale), w32)
    q = xp.clip(xp.round(scaled), -qmax, qmax).astype(dtype) if quantization == "int8" else scaled.astype(dtype)
    return q, xp.squeeze(scale, axis=tuple(in_axes))


def _elementwise(divisor: Any, like: Any) -> Any:
    """`divisor` as a divisor XLA divides by exactly, so that the host (numpy) and the devices give the same q and
    scales (bit for bit; `checkpoints_convert --quantization` and a float folder quantized at load agree):
    XLA rewrites `x / c` (c a constant or a broadcast) into `x * (1 / c)`, an ulp off, which moves the
    round-half-to-even ties that grid-valued weights (dequantized GGUF blocks) are full of. `divisor + 0 * like`
    is the same values at `like`'s shape and not a broadcast (`0 * x` is not folded for floats); it fuses into
    the division, so nothing is materialized. numpy divides exactly as it is."""
    return divisor if isinstance(like, np.ndarray) else divisor + like * 0


def dequantize_kernel(q: Any, scale: Any, in_axes: Sequence[int]) -> Any:
    """`q * scale` in float32, the scales broadcast over `in_axes`: the weights a quantized model computes with."""
    xp = np if isinstance(q, np.ndarray) else jnp
    return q.astype(xp.float32) * xp.expand_dims(scale, tuple(in_axes))


def quantize_tree(params: Any, target_axes: Any, quantization: str) -> Any:
    """Float params -> the same tree with every kernel that has a `kernel_scale` in `target_axes` (the logical
    axes tree of the quantized model, same layout as `params`) replaced by `(kernel, kernel_scale)`, in place
    (each float kernel is dropped as soon as its q exists). On the devices the kernels are on, sharded as they
    are (a scale takes its kernel's sharding of the output axes). Returns `params`."""
    for key, child in list(params.items()):
        if isinstance(child, dict):
            quantize_tree(child, target_axes[key], quantization)
    if KERNEL_SCALE in target_axes and "kernel" in params and KERNEL_SCALE not in params:
        in_axes = contracting_axes(tuple(target_axes["kernel"]), tuple(target_axes[KERNEL_SCALE]))
        kernel = params.pop("kernel")
        quantize = _quantize_fn(in_axes, quantization, kernel.sharding, kernel.ndim)
        params["kernel"], params[KERNEL_SCALE] = quantize(kernel)
    return params


@functools.cache
def _quantize_fn(in_axes: tuple[int, ...], quantization: str, sharding: Any, ndim: int) -> Any:
    """`quantize_kernel` jitted into the kernel's `sharding` (q) and its output axes' (scale); one compile per
    shape."""
    fn = functools.partial(quantize_kernel, in_axes=in_axes, quantization=quantization)
    if not isinstance(sharding, NamedSharding):
        return jax.jit(fn)
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    scale_spec = PartitionSpec(*(s for i, s in enumerate(spec) if i not in in_axes))
    return jax.jit(fn, out_shardings=(sharding, NamedSharding(sharding.mesh, scale_spec)))
