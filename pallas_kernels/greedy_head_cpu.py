"""The LM head and the greedy sampler in one pass on CPUs: the C++ kernel `pallas_kernels/cpu/greedy_head.cc`,
called through `jax.ffi` (the greedy-only sampler of a float32 CPU engine: `sarathi_jax/runner/sample/sampler.py`).

    greedy_head_cpu(h [R, K], w [V, K], banned [R, B]) -> (tokens int32[R], logprobs float32[R])

with logits = h . w^T (never written out):
  * tokens[r]: the first v of the largest logits[r, v], the ids banned[r] (-1 pads; ids outside [0, V)
    ignored) at -inf; V - 1 where those masked logits hold a NaN; 0 where all of them are -inf;
  * logprobs[r]: logits[r, tokens[r]] - logsumexp(logits[r]) over the raw logits.
That is `sarathi_jax.runner.sample.vocab_major.greedy_vocab_major` on `h . w^T` transposed; its float64 oracle is
`greedy_head_reference` below. R is at most `MAX_ROWS`.

Why: the greedy sampler of a decode or mixed step computes the logits [R, V] with XLA's dot (YNNPACK, which
packs its right operand on every call: the whole head, when the head is on the right), writes them, then
reduces them in further passes (argmax, logsumexp). The kernel reads the head once, in place, and folds every
block of logits into per-row running state while it is in registers or L1 (the C++ file's header says how).
Its sums run in another order than XLA's dot: logits, and so a token on a near tie, can differ from the jnp
path by float32 rounding, as between the jnp path's own two layouts.

It lives in the CPU matmul library (`pallas_kernels._cpu_matmul`, built by `pip install -e .`); where that was
not built, `greedy_head_status()` says why and the engine keeps the jnp sampler. Like the panel matmul the
engine uses it only from a build for AVX-512 (`engine_uses_kernel`): unmeasured elsewhere.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ffi_library import first_call_status, load_ffi_library
from pallas_kernels.panel_matmul_cpu import vector_bits

_TARGET = "sarathi_greedy_head"
_MODULE = "pallas_kernels._cpu_matmul"

# The most rows one call takes (the C++ kernel's kMaxRows): four AVX-512 vectors of rows.
MAX_ROWS = 64


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded library, None), or (None, why not)."""
    lib, origin = load_ffi_library(_MODULE, _TARGET, "SarathiGreedyHead", "CPU greedy LM head kernel")
    return (lib, None) if lib is not None else (None, origin)


@functools.cache
def greedy_head_status() -> str | None:
    """None when the C++ kernel is built, registered with XLA and passed one tiny first call; otherwise why not.
    Evaluated eagerly even when first asked inside a trace."""
    lib, why = _library()
    if lib is None:
        return why

    def first_call() -> bool:
        h = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
        w = np.array([[1.0, 2.0], [3.0, -1.0], [3.0, 5.0]], np.float32)
        tokens, _ = _call(h, w, np.array([[-1], [2]], np.int32))
        return np.asarray(tokens).tolist() == [1, 0]  # row 0: 3 at ids 1 and 2 -> 1; row 1: 5 banned -> 2 at 0

    return first_call_status("CPU greedy LM head kernel", first_call)


def engine_uses_kernel() -> bool:
    """Whether a float32 CPU engine's greedy-only sampler uses the kernel: built, working, for AVX-512."""
    return greedy_head_status() is None and vector_bits() == 512


def _call(h, w, banned):
    rows = h.shape[0]
    out = (jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32))
    return jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")(h, w, banned)


def greedy_head_cpu(h: jax.Array, w: jax.Array, banned: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens int32[R], logprobs float32[R]) of the logits `h [R, K] . w [V, K]^T`, `banned [R, B]` ids at -inf
    for the tokens (see the module docstring).

    Raises:
      RuntimeError: the kernel is not usable here (see `greedy_head_status`).
      ValueError: shapes or dtypes outside the contract.
    """
    status = greedy_head_status()
    if status is not None:
        raise RuntimeError(status)
    if h.ndim != 2 or w.ndim != 2 or h.shape[1] != w.shape[1] or banned.ndim != 2 or banned.shape[0] != h.shape[0]:
        raise ValueError(f"h {h.shape} must be [R, K], w {w.shape} [V, K] and banned {banned.shape} [R, B]")
    if h.shape[0] > MAX_ROWS:
        raise ValueError(f"h has {h.shape[0]} rows; the kernel takes at most {MAX_ROWS}")
    if w.shape[0] == 0:
        raise ValueError("w has no rows: an empty vocabulary")
    if h.dtype != jnp.float32 or w.dtype != jnp.float32 or banned.dtype != jnp.int32:
        raise ValueError(f"h and w must be float32 and banned int32, got {h.dtype}, {w.dtype} and {banned.dtype}")
    return _call(h, w, banned)


def greedy_head_reference(h: np.ndarray, w: np.ndarray, banned: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float64 oracle of `greedy_head_cpu`: (tokens int32[R], logprobs float64[R])."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and inf - inf: NaN, as in float32
        logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T  # [R, V]
    rows, vocab = logits.shape
    masked = logits.copy()
    for r in range(rows):
        ids = [int(b) for b in banned[r] if 0 <= b < vocab]
        masked[r, ids] = -np.inf
    tokens = np.zeros(rows, np.int32)
    logprobs = np.zeros(rows, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        for r in range(rows):
            if np.isnan(masked[r]).any():
                tokens[r] = vocab - 1
            elif np.all(masked[r] == -np.inf):
                tokens[r] = 0
            else:
                tokens[r] = int(np.argmax(masked[r]))  # the first index of the max
            row = logits[r]
            top = np.max(row) if not np.isnan(row).any() else np.nan
            if np.isnan(top):
                lse = np.nan
            elif np.isinf(top):
                lse = top
            else:
                lse = top + np.log(np.sum(np.exp(row - top)))
            logprobs[r] = row[tokens[r]] - lse
    return tokens, logprobs
