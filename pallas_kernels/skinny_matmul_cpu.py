"""A float32 matmul for few rows on CPUs: the C++ kernel `pallas_kernels/cpu/skinny_matmul.cc`, called through
`jax.ffi` (the layers' projections of small steps on a CPU: `sarathi_jax/models/out_major.py`).

    skinny_matmul_cpu(x [M, K], w [N, K]) -> [M, N] = x . w^T        float32; w out-major (HF's layout)

Its reference is `skinny_matmul_reference` (float64 numpy) below. The C++ file's header says how the work is
split. Sums run in another order than XLA's dot: equal to float32 rounding.

Why a kernel: XLA:CPU hands a dot to YNNPACK, which packs an operand into its tile layout on every call; at a
decode step's few rows the weights' bytes set the pace, and the packing and per-call overheads cost about as
much again. Over the unrolled layer stack of the 60M Llama (8 layers of q/k/v, o, gate+up and down), on the
2-core AVX-512 machine, it took 0.63x XLA's time at 1 row, 0.78-0.87x at 8-32, and 1.07x at 64
(`python -m sarathi_jax.bench.probes.layer_matmul_cost`; docs/results-cpu.md §11, ninth session). So the
engine uses it for steps of at most `MAX_ROWS` rows, and only from a build for AVX-512 (`vector_bits`):
an earlier kernel of this kind (reading `[K, N]`) lost to XLA's dot on an AVX2 machine, and this one is
unmeasured there.

It is built when the package is installed (`setup.py`, as the attention kernel: a C++17 compiler, jaxlib's
FFI headers, `-march=native`). Where it was not built, or fails one tiny first call, `cpu_matmul_status()`
says why and the engine keeps XLA's dot; calling `skinny_matmul_cpu` then raises. The FFI target is registered
for the CPU platform only.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ffi_library import load_ffi_library

_TARGET = "sarathi_skinny_matmul"
_MODULE = "pallas_kernels._cpu_matmul"

# The most rows a step may have for the engine to use the kernel (see the module docstring).
MAX_ROWS = 32


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded library, None), or (None, why not)."""
    lib, origin = load_ffi_library(_MODULE, _TARGET, "SarathiSkinnyMatmul", "CPU matmul kernel")
    if lib is None:
        return None, origin
    try:
        lib.SarathiSkinnyMatmulVectorBits.restype = ctypes.c_int
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
    try:
        with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
            x = np.arange(6, dtype=np.float32).reshape(2, 3)
            w = np.arange(12, dtype=np.float32).reshape(4, 3)
            ok = bool(np.array_equal(np.asarray(_call(x, w)), x @ w.T))
    except Exception as e:  # noqa: BLE001 - any failure of the library means "not usable here"
        return f"the CPU matmul kernel failed its first call: {type(e).__name__}: {e}"
    return None if ok else "the CPU matmul kernel computed a wrong result on its first call"


def vector_bits() -> int | None:
    """The vector width the kernel was built for (512: AVX-512, 256: others), None where it is not usable."""
    lib, _ = _library()
    return None if lib is None or cpu_matmul_status() is not None else int(lib.SarathiSkinnyMatmulVectorBits())


def engine_uses_kernel() -> bool:
    """Whether the engine's out-major projections of small steps use the kernel: built, working, for AVX-512."""
    return vector_bits() == 512


def _call(x, w):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")(x, w)


def skinny_matmul_cpu(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [M, K] . w [N, K]^T`, float32 `[M, N]`, by the C++ kernel (any M; it is built for few).

    Raises:
      RuntimeError: the kernel is not usable here (see `cpu_matmul_status`).
      ValueError: shapes or dtypes outside the contract.
    """
    status = cpu_matmul_status()
    if status is not None:
        raise RuntimeError(status)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {x.shape} must be [M, K] and w {w.shape} [N, K]")
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"x and w must be float32, got {x.dtype} and {w.dtype}")
    return _call(x, w)


def skinny_matmul_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The float64 oracle: `x [M, K] . w [N, K]^T`."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
