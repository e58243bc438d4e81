"""The small-M matmul on CPUs: the C++ kernel `pallas_kernels/cpu/small_m_matmul.cc`, called through `jax.ffi`,
for a decode step's layer matmuls `x [M, K] @ w [K, N]` with few rows (see `MAX_ROWS`).

Why: XLA:CPU's dot (YNNPACK) packs its right operand, the weight, on every call; at M of 1-32 rows that copy
costs as much as the product itself. The kernel reads the weight where it lies (the C++ header has the
details). float32 or bfloat16, one dtype for x, w and the result, float32 accumulation.

Built with the attention kernel (`setup.py`); where it was not built, or fails a tiny first call,
`cpu_matmul_status()` says why and the models keep XLA's dot. The FFI target is registered for the CPU
platform only.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

_TARGET = "sarathi_small_m_matmul"
_MODULE = "pallas_kernels._cpu_matmul"
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# The most rows the models send to the kernel: from there on XLA's packed dot is as fast (its packing is
# shared by more rows). Measured by `python -m sarathi_jax.bench.probes.layer_matmul_cost` (docs/results-cpu.md
# §11).
MAX_ROWS = 32


@functools.cache
def cpu_matmul_status() -> str | None:
    """None when the C++ matmul is built and registered with XLA; otherwise why it is not available."""
    try:
        spec = importlib.util.find_spec(_MODULE)
    except ImportError as e:  # pragma: no cover - a broken package
        return f"{_MODULE}: {e}"
    if spec is None or not spec.origin:
        return f"the CPU matmul kernel was not built ({_MODULE} is missing): reinstall with a C++17 compiler"
    try:
        lib = ctypes.CDLL(spec.origin)
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.SarathiSmallMMatmul), platform="cpu")
    except (OSError, AttributeError, RuntimeError, ValueError) as e:
        return f"the CPU matmul kernel at {spec.origin} could not be loaded: {e}"
    try:
        # Eager even when first asked inside a trace (a jitted model step).
        with jax.default_device(jax.devices("cpu")[0]), jax.ensure_compile_time_eval():
            x = np.arange(6, dtype=np.float32).reshape(2, 3)
            w = np.arange(12, dtype=np.float32).reshape(3, 4)
            ok = bool(np.array_equal(np.asarray(_call(x, w)), x @ w))
    except Exception as e:  # noqa: BLE001 - any failure of the library means "not usable here"
        return f"the CPU matmul kernel at {spec.origin} failed its first call: {type(e).__name__}: {e}"
    return None if ok else f"the CPU matmul kernel at {spec.origin} computed a wrong result on its first call"


def _call(x, w):
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype),
                            vmap_method="sequential")
    return call(x, w)


def small_m_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [M, K] @ w [K, N]` by the C++ kernel, `[M, N]` in x's dtype (float32 sums in order of k).

    Raises:
      RuntimeError: the kernel is not built (see `cpu_matmul_status`).
      ValueError: shapes or dtypes outside the contract.
    """
    status = cpu_matmul_status()
    if status is not None:
        raise RuntimeError(status)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x {x.shape} must be [M, K] and w {w.shape} [K, N]")
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"x and w must share one dtype of {[str(d) for d in SUPPORTED_DTYPES]}, got {x.dtype}, {w.dtype}")
    return _call(x, w)


def small_m_tensordot(x: jax.Array, kernel: jax.Array, num_contracting: int) -> jax.Array:
    """`jnp.tensordot(x, kernel, num_contracting)` for x `[M, in...]` and kernel `[in..., out...]` (row-major
    arrays: the reshapes to 2-D are free), by `small_m_matmul`."""
    k = int(np.prod(kernel.shape[:num_contracting]))
    out_shape = kernel.shape[num_contracting:]
    y = small_m_matmul(x.reshape(x.shape[0], k), kernel.reshape(k, -1))
    return y.reshape(x.shape[0], *out_shape)
