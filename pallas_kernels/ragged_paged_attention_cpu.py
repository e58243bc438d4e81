"""Ragged paged attention on CPUs: the C++ kernel `pallas_kernels/cpu/ragged_paged_attention.cc`, called
through `jax.ffi` (the engine's `"cpu"` attention backend; its float64 oracle is `pallas_kernels/reference.py`).

Arguments, shapes and semantics: exactly those of the Pallas kernel (the docstring of
`pallas_kernels/ragged_paged_attention.py`), for float32 or bfloat16 q / k_pages / v_pages of one dtype.
How the kernel splits the work is in the C++ file's header.

The kernel is built when the package is installed (`setup.py`: a C++17 compiler and jaxlib's FFI headers,
`-march=native`). Where it was not built, or fails one tiny first call (a library built against another
jaxlib's FFI, say), `cpu_kernel_status()` says why, `attention_backend="auto"` uses the
portable jnp path instead, and calling `ragged_paged_attention_cpu` raises. The FFI target is registered for
the CPU platform only: on a GPU or TPU the engine uses the Pallas kernel or the jnp path.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ffi_library import first_call_status, load_ffi_library

_TARGET = "sarathi_ragged_paged_attention"
_MODULE = "pallas_kernels._cpu_attention"
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Static split sizes (see the C++ header): matrix rows (query rows x G) per unit and KV head; the shortest KV
# range that gets a part of its own when a batch has fewer row blocks than twice the threads (split-KV).
# 128 rows, not 64: a unit copies and transposes every K/V tile it reads once for all its rows, and 128 took
# 0.90-0.95x the time of 64 on prefill chunks of 288-512 tokens and mixed steps (heads 8/8/64, 9/3/64,
# 32/8/128), no different on decodes and short prefills.
UNIT_ROWS = 128
MIN_PART_TOKENS = 256


@functools.cache
def cpu_kernel_status() -> str | None:
    """None when the C++ kernel is built and registered with XLA; otherwise why it is not available. Evaluated
    eagerly even when first asked inside a trace (a jitted caller's first call)."""
    lib, origin = load_ffi_library(_MODULE, _TARGET, "SarathiRaggedPagedAttention", "CPU attention kernel")
    return origin if lib is None else _smoke_test(origin)


def _smoke_test(origin: str) -> str | None:
    """One tiny call on the CPU (a token attending to itself returns its value row)."""

    def first_call() -> bool:
        v = np.arange(16, dtype=np.float32).reshape(1, 1, 1, 16)  # numpy inputs: one compile, the call's
        out = _call(np.ones((1, 1, 16), np.float32), np.ones((1, 1, 1, 16), np.float32), v,
                    np.ones((1,), np.int32), np.zeros((1, 1), np.int32), np.array([0, 1], np.int32),
                    np.ones((1,), np.int32), sm_scale=1.0, unit_rows=UNIT_ROWS, min_part_tokens=MIN_PART_TOKENS)
        return np.array_equal(np.asarray(out).reshape(16), np.arange(16, dtype=np.float32))

    return first_call_status(f"CPU attention kernel at {origin}", first_call)


def _call(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale, unit_rows,
          min_part_tokens, target=_TARGET):
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=np.float32(sm_scale),
                unit_rows=np.int32(unit_rows), min_part_tokens=np.int32(min_part_tokens))


def ragged_paged_attention_cpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    unit_rows: int = UNIT_ROWS,
    min_part_tokens: int = MIN_PART_TOKENS,
) -> jax.Array:
    """Ragged paged attention by the C++ CPU kernel: `[T, num_q_heads, head_dim]` in q's dtype.

    `unit_rows` and `min_part_tokens` are the static split sizes (module constants; the tests use small ones).

    Raises:
      RuntimeError: the kernel is not built (see `cpu_kernel_status`).
      ValueError: shapes or dtypes outside the contract.
    """
    status = cpu_kernel_status()
    if status is not None:
        raise RuntimeError(status)
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    if q.ndim != 3 or k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"q {q.shape} must be [T, Hq, D] and k_pages {k_pages.shape} / v_pages {v_pages.shape} "
                         "one shape [num_blocks, block_size, Hkv, D]")
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_pages.shape[2]
    if k_pages.shape[3] != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {q.shape} and the cache {k_pages.shape}: head_dim differs, or num_q_heads is not a "
                         "multiple of num_kv_heads")
    if not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q, k_pages and v_pages must share one dtype of {[str(d) for d in SUPPORTED_DTYPES]}, "
                         f"got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    block_tables = jnp.asarray(block_tables, jnp.int32)
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables {block_tables.shape} must be [max_num_seqs, max_blocks]")
    max_num_seqs = block_tables.shape[0]
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    cu_q_lens = jnp.asarray(cu_q_lens, jnp.int32)
    if kv_lens.shape != (max_num_seqs,) or cu_q_lens.shape != (max_num_seqs + 1,):
        raise ValueError(f"kv_lens {kv_lens.shape} and cu_q_lens {cu_q_lens.shape} must be [{max_num_seqs}] and "
                         f"[{max_num_seqs + 1}] for block_tables {block_tables.shape}")
    num_seqs = jnp.reshape(jnp.asarray(num_seqs, jnp.int32), (1,))
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    if unit_rows < 1 or min_part_tokens < 1:
        raise ValueError(f"unit_rows={unit_rows} and min_part_tokens={min_part_tokens} must be positive")
    return _call(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=sm_scale,
                 unit_rows=unit_rows, min_part_tokens=min_part_tokens)


def kernel_of_library(path: str, target: str) -> Callable[..., jax.Array]:
    """Another build of this kernel (a .so from another checkout, say), registered under its own FFI target
    name: a jitted `fn(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)` with the default
    split sizes, for timing two builds side by side in one process (`python -m benchmarks.kernels
    --baseline-library`). Inputs are not validated: pass what `ragged_paged_attention_cpu` accepts."""
    lib = ctypes.CDLL(path)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.SarathiRaggedPagedAttention), platform="cpu")

    def fn(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs):
        return _call(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, jnp.reshape(num_seqs, (1,)),
                     sm_scale=q.shape[-1] ** -0.5, unit_rows=UNIT_ROWS, min_part_tokens=MIN_PART_TOKENS,
                     target=target)

    return jax.jit(fn)
