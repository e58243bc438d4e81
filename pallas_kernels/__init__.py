"""Kernels for sarathi-jax: ragged paged attention over a fixed-shape padded token budget, CPU matmuls on packed
weights (float32 and int8) and a CPU greedy LM head."""

from __future__ import annotations

import functools
from typing import Callable

import jax

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_cpu import cpu_kernel_status, ragged_paged_attention_cpu
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla
from pallas_kernels.greedy_head_cpu import greedy_head_status
from pallas_kernels.panel_matmul_cpu import cpu_matmul_status, int8_matmul_status

__all__ = [
    "ragged_paged_attention_xla", "ragged_paged_attention", "ragged_paged_attention_cpu", "cpu_kernel_status",
    "get_attention_fn", "ATTENTION_BACKENDS", "cpu_matmul_status", "int8_matmul_status",
    "greedy_head_status",
]

ATTENTION_BACKENDS = ("xla", "pallas", "cpu")


def get_attention_fn(backend: str, *, interpret: bool | None = None) -> Callable[..., jax.Array]:
    """Returns a ragged paged attention function with the `ragged_paged_attention_xla` signature.

    Args:
      backend: `"xla"` (plain jnp, runs everywhere), `"pallas"` (the Pallas kernel; Triton on GPU) or `"cpu"`
        (the C++ kernel through jax.ffi, on CPUs where it was built: see `cpu_kernel_status`).
      interpret: only for `"pallas"`: run the kernel through the Pallas interpreter. `None` means
        "interpret when `jax.default_backend() == "cpu"`". On TPU the Pallas kernel has no compiled path
        (see `ragged_paged_attention`), so `"pallas"` on a non-GPU backend requires `interpret=True`.

    Raises:
      ValueError: unknown backend name.
      NotImplementedError: `"pallas"` with interpret=False on a non-GPU default backend.
      RuntimeError: `"cpu"` where the C++ kernel was not built.
    """
    if backend == "xla":
        return ragged_paged_attention_xla
    if backend == "cpu":
        status = cpu_kernel_status()
        if status is not None:
            raise RuntimeError(status)
        return ragged_paged_attention_cpu
    if backend == "pallas":
        platform = jax.default_backend()
        if interpret is None:
            interpret = platform == "cpu"
        if not interpret and platform not in ("gpu", "cuda", "rocm"):
            raise NotImplementedError(
                f"the compiled Pallas ragged paged attention kernel targets GPU (Triton), not {platform!r}; "
                "use backend 'xla' there, or interpret=True for testing"
            )
        return functools.partial(ragged_paged_attention, interpret=bool(interpret))
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {list(ATTENTION_BACKENDS)}")
