"""`pallas_kernels.ffi_library`, the CPU kernels' one loader and first-call check: every kernel's status, first
asked inside a trace (a jitted caller's first call), is the eager one (it once failed there for the attention
kernel, and the cached failure kept the kernel off for the whole process)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import pytest

STATUSES = [("pallas_kernels.ragged_paged_attention_cpu", "cpu_kernel_status"),
            ("pallas_kernels.panel_matmul_cpu", "cpu_matmul_status"),
            ("pallas_kernels.panel_matmul_cpu", "int8_matmul_status"),
            ("pallas_kernels.greedy_head_cpu", "greedy_head_status")]


@pytest.mark.parametrize("module, name", STATUSES)
def test_the_status_first_asked_inside_a_trace_is_the_eager_one(module, name):
    status = getattr(importlib.import_module(module), name)  # by module: the package exports functions of its names
    status.cache_clear()
    seen = []

    @jax.jit
    def first_call(x):
        seen.append(status())
        return x

    try:
        first_call(jnp.ones(2))
        assert seen == [None]
    finally:
        status.cache_clear()
    assert status() is None
