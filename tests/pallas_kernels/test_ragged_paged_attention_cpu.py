"""The C++ CPU kernel (`pallas_kernels/ragged_paged_attention_cpu.py`) against the float64 numpy reference
(`pallas_kernels/reference.py`), on the shared poisoned inputs of `kernel_cases.py`: NaN in padding query
rows, unowned pages, slots past kv_len and block-table entries past a sequence's last block. Error measure
and bounds as in test_ragged_paged_attention.py.

The kernel must be built (`pip install -e .` builds it); these tests fail, never skip, where it is not.
Static split sizes are varied so that every path runs: units of one row or of many (`unit_rows`), split-KV
parts merged afterwards (`min_part_tokens`: a batch with fewer row blocks than twice the threads splits), the
direct path (fewer than 16 matrix rows per KV head, head_dim a multiple of 16) and the copying one (more
rows, or another head_dim), block sizes that hold less than, exactly, or several 16-token chunks, and KV
ranges (up to 128 tokens, parts starting at any multiple of 16) that fill part of, one or two of the copying
path's 64-token tiles, with blocks of rows on and off the causal diagonal.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels import cpu_kernel_status, get_attention_fn, ragged_paged_attention_cpu
from pallas_kernels.reference import ragged_paged_attention_reference as reference
from tests.pallas_kernels.kernel_cases import (
    CONFIGS, EDGE_CASES, HYPO, MAX_NUM_SEQS, NUM_TOKENS, TOL, Batch, Cfg, assert_matches_reference, batches,
    make_inputs,
)

# The module (the package exports a function of the same name).
cpu_module = importlib.import_module("pallas_kernels.ragged_paged_attention_cpu")

CPU_CONFIGS = [c for c in CONFIGS if c.config is None] + [
    Cfg("float32", 4, 4, 80, 8),     # head_dim 80: direct path with a run-time vector count; pages of 8
    Cfg("float32", 6, 2, 40, 64),    # head_dim 40: copying path (zero-padded to 48); 4 chunks per page
    Cfg("bfloat16", 9, 3, 64, 16),   # SmolLM2's heads (G = 3)
    Cfg("float32", 16, 2, 128, 16),  # G = 8, head_dim 128
]
# (unit_rows, min_part_tokens): the defaults, one row per unit and heavy splitting, and in between.
SPLITS = [(cpu_module.UNIT_ROWS, cpu_module.MIN_PART_TOKENS), (1, 1), (8, 16), (16, 48)]


def test_kernel_is_built():
    assert cpu_kernel_status() is None, cpu_kernel_status()


@functools.cache
def _jitted(unit_rows: int, min_part_tokens: int):
    return jax.jit(functools.partial(ragged_paged_attention_cpu, unit_rows=unit_rows, min_part_tokens=min_part_tokens))


def check(cfg: Cfg, batch: Batch, seed: int, splits=SPLITS[0]):
    args = make_inputs(cfg, batch, seed)
    assert_matches_reference(_jitted(*splits)(*args), args, cfg, f"{cfg} {batch} {splits}")


@pytest.mark.parametrize("mode", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("cfg", CPU_CONFIGS, ids=str)
def test_random_batches(cfg, mode):
    @HYPO
    @given(batch=batches(cfg, mode), seed=st.integers(0, 2**31 - 1), splits=st.sampled_from(SPLITS))
    def inner(batch, seed, splits):
        check(cfg, batch, seed, splits)

    inner()


@pytest.mark.parametrize("splits", SPLITS, ids=str)
@pytest.mark.parametrize("case", list(EDGE_CASES))
@pytest.mark.parametrize("cfg", [CPU_CONFIGS[0], CPU_CONFIGS[4], CPU_CONFIGS[7], CPU_CONFIGS[8]], ids=str)
def test_edge_cases(cfg, case, splits):
    check(cfg, EDGE_CASES[case], seed=hash(case) % 1000, splits=splits)


def test_one_long_decode_splits_its_kv_and_merges():
    """A lone decode at the cache's capacity: the batch has one row block, so its KV range is cut into parts
    (one per 16 tokens with min_part_tokens=16, at most twice the threads) and merged; the same for a lone
    prefill chunk."""
    for cfg in (CPU_CONFIGS[0], CPU_CONFIGS[-1]):
        for batch in (Batch([1], [127]), Batch([9], [100])):
            for splits in ((64, 16), (64, 10**6)):
                check(cfg, batch, seed=3, splits=splits)


def test_garbage_metadata_never_reads_outside_the_cache():
    """Metadata outside the contract (kv_lens past the table's capacity or below q_len, cu_q_lens past T or
    decreasing, num_seqs past S, block ids outside the cache) gives some output, no crash, and leaves the rows
    past the clamped last sequence at zero."""
    cfg = CPU_CONFIGS[0]
    q, k, v, kv_lens, bt, cu, _ = make_inputs(cfg, Batch([2, 3], [5, 5]), seed=0)
    kv_lens = np.array([10**6, 1, -5, 4, 2], np.int32)
    cu = np.array([0, 2, 10**6, 1, 3, 3], np.int32)
    bt = np.where(np.arange(bt.size).reshape(bt.shape) % 2 == 0, 10**8, -(10**8)).astype(np.int32)
    for n in (MAX_NUM_SEQS, 10**6, -1):
        out = np.asarray(_jitted(*SPLITS[1])(q, k, v, kv_lens, bt, cu, np.array([n], np.int32)))
        assert out.shape == (NUM_TOKENS, cfg.num_q_heads, cfg.head_dim)
        if n < 0:
            assert np.all(out == 0.0)


def test_in_a_scan_over_layers_matches_eager_calls():
    """The model calls the kernel inside `nn.scan` over a stacked cache, its block ids offset by the layer
    (`layer_view`): the same rows as one call per layer."""
    cfg = CPU_CONFIGS[1]
    q0, k0, v0, kv_lens, bt, cu, n = make_inputs(cfg, Batch([5, 1, 20], [3, 60, 0]), seed=1)
    layers = [(q0 * (i + 1), k0 + i, v0 - i) for i in range(3)]  # NaN poison stays NaN
    q = jnp.stack([a[0] for a in layers])
    k = jnp.concatenate([a[1] for a in layers])
    v = jnp.concatenate([a[2] for a in layers])
    num_blocks = k0.shape[0]

    def body(_, xs):
        qi, layer = xs
        return None, ragged_paged_attention_cpu(qi, k, v, kv_lens, bt + layer * num_blocks, cu, n)

    _, scanned = jax.jit(lambda q: jax.lax.scan(body, None, (q, jnp.arange(3))))(q)
    for i, (qi, ki, vi) in enumerate(layers):
        eager = ragged_paged_attention_cpu(qi, k, v, kv_lens, bt + i * num_blocks, cu, n)
        np.testing.assert_array_equal(np.asarray(scanned[i]), np.asarray(eager))
        ref = reference(qi, ki, vi, kv_lens, bt, cu, n, sm_scale=cfg.head_dim**-0.5)
        assert np.abs(np.asarray(scanned[i])[:26] - ref[:26]).max() <= TOL["float32"] * np.abs(ref[:26]).max()


def test_inputs_are_validated_up_front():
    cfg = CPU_CONFIGS[0]
    q, k, v, kv_lens, bt, cu, n = make_inputs(cfg, Batch([2], [3]), seed=0)
    with pytest.raises(ValueError, match="one dtype"):
        ragged_paged_attention_cpu(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), kv_lens, bt,
                                   cu, n)
    with pytest.raises(ValueError, match="one dtype"):
        ragged_paged_attention_cpu(q, k.astype(jnp.bfloat16), v, kv_lens, bt, cu, n)
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention_cpu(q[..., :32], k, v, kv_lens, bt, cu, n)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_paged_attention_cpu(q[:, :1], k, v, kv_lens, bt, cu, n)
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention_cpu(q, k, v, kv_lens, bt, cu[:-1], n)
    with pytest.raises(ValueError, match="must be positive"):
        ragged_paged_attention_cpu(q, k, v, kv_lens, bt, cu, n, unit_rows=0)
    assert get_attention_fn("cpu") is ragged_paged_attention_cpu


def test_a_missing_kernel_is_reported_not_called(monkeypatch):
    """Where the library was not built, the status says so (and how to build it), and the kernel and the
    "cpu" backend refuse with that message; the engine's "auto" then picks the jnp path (test_config_defaults)."""
    monkeypatch.setattr(cpu_module, "_MODULE", "pallas_kernels._no_such_kernel")
    cpu_module.cpu_kernel_status.cache_clear()
    try:
        status = cpu_module.cpu_kernel_status()
        assert status is not None and "was not built" in status and "pip install -e ." in status
        with pytest.raises(RuntimeError, match="was not built"):
            cpu_module.ragged_paged_attention_cpu(*make_inputs(CPU_CONFIGS[0], Batch([1], [1]), seed=0))
        with pytest.raises(RuntimeError, match="was not built"):
            get_attention_fn("cpu")
    finally:
        monkeypatch.undo()
        cpu_module.cpu_kernel_status.cache_clear()
    assert cpu_module.cpu_kernel_status() is None


@pytest.mark.parametrize("failure", ["raises", "wrong"])
def test_a_library_that_fails_its_first_call_is_not_used(monkeypatch, failure):
    """A library that loads but cannot run here (built against another jaxlib's FFI, say) is caught by the
    status's one tiny call, so that the engine falls back to the jnp path instead of failing its first step."""
    def broken(*args, **kwargs):
        if failure == "raises":
            raise RuntimeError("FFI API version mismatch")
        return jnp.zeros((1, 1, 16), jnp.float32)

    monkeypatch.setattr(cpu_module, "_call", broken)
    cpu_module.cpu_kernel_status.cache_clear()
    try:
        status = cpu_module.cpu_kernel_status()
        expected = "failed its first call: RuntimeError: FFI API" if failure == "raises" else "wrong result"
        assert status is not None and expected in status
    finally:
        monkeypatch.undo()
        cpu_module.cpu_kernel_status.cache_clear()
    assert cpu_module.cpu_kernel_status() is None
