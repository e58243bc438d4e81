"""Ragged paged attention as its callers meet it: argument validation (and the Triton-only constraints),
backend selection, lowering for a GPU through Triton on a CPU-only machine, and the benchmark script. The
kernel's numbers against the float64 reference are in test_ragged_paged_attention.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import get_attention_fn, ragged_paged_attention, ragged_paged_attention_xla
from pallas_kernels.ragged_paged_attention import KernelConfig, TileConfig, _next_pow2, resolve_kernel_config
from tests.pallas_kernels.kernel_cases import CONFIGS, Batch, make_inputs


# ---------------------------------------------------------------------------------------------------------
# Validation


def _valid_args(dtype=jnp.float32, hq=4, hkv=2, d=64, bs=16, nb=8, s=3, mb=4, t=16):
    return dict(
        q=jnp.zeros((t, hq, d), dtype),
        k_pages=jnp.zeros((nb, bs, hkv, d), dtype),
        v_pages=jnp.zeros((nb, bs, hkv, d), dtype),
        kv_lens=jnp.array([5, 1, 0], jnp.int32)[:s],
        block_tables=jnp.zeros((s, mb), jnp.int32),
        cu_q_lens=jnp.array([0, 5, 6, 6], jnp.int32)[: s + 1],
        num_seqs=jnp.array([2], jnp.int32),
    )


def _call(**overrides):
    args = _valid_args()
    kw = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return ragged_paged_attention(**args, interpret=True, **kw)


def test_valid_args_pass():
    out = _call()
    assert out.shape == (16, 4, 64)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(q=jnp.zeros((16, 4, 64), jnp.bfloat16)), "dtype"),
        (dict(k_pages=jnp.zeros((8, 16, 2, 64), jnp.bfloat16), v_pages=jnp.zeros((8, 16, 2, 64), jnp.bfloat16)), "dtype"),
        (dict(v_pages=jnp.zeros((8, 16, 2, 64), jnp.bfloat16)), "dtype"),
        (dict(q=jnp.zeros((16, 3, 64), jnp.float32)), "multiple of num_kv_heads"),
        (dict(q=jnp.zeros((16, 4, 32), jnp.float32)), "head_dim"),
        (dict(v_pages=jnp.zeros((8, 16, 2, 32), jnp.float32)), "shapes differ"),
        (dict(q=jnp.zeros((16, 256), jnp.float32)), "q must be"),
        (dict(q=jnp.zeros((16, 4, 64), jnp.int32), k_pages=jnp.zeros((8, 16, 2, 64), jnp.int32), v_pages=jnp.zeros((8, 16, 2, 64), jnp.int32)), "unsupported dtype"),
        (dict(block_tables=jnp.zeros((2, 4), jnp.int32)), "block_tables must be"),
        (dict(cu_q_lens=jnp.zeros((3,), jnp.int32)), "cu_q_lens must be"),
        (dict(num_seqs=jnp.zeros((2,), jnp.int32)), "num_seqs"),
        (dict(kv_lens=jnp.zeros((3,), jnp.float32)), "integer"),
        # Concrete values: a kv_len the block table cannot hold (4 blocks * 16 = 64 tokens).
        (dict(kv_lens=jnp.array([65, 1, 0], jnp.int32)), "max_blocks_per_seq"),
        (dict(kv_lens=jnp.array([4, 1, 0], jnp.int32)), "shorter than its query length"),
        (dict(num_seqs=jnp.array([4], jnp.int32)), "num_seqs"),
        (dict(cu_q_lens=jnp.array([0, 5, 17, 17], jnp.int32), kv_lens=jnp.array([5, 12, 0], jnp.int32)), "exceeds"),
        (dict(block_q=3), "power of two"),
        (dict(block_q=4), ">= 16"),  # 4 * next_pow2(2) = 8 rows: too small for tt.dot
        (dict(num_kv_pages_per_block=3), "power of two"),
        (dict(k_pages=jnp.zeros((8, 8, 2, 64)), v_pages=jnp.zeros((8, 8, 2, 64)), num_kv_pages_per_block=1), ">= 16"),
        (dict(num_kv_splits=3), "power of two"),
        (dict(config=KernelConfig(TileConfig(3, 1), TileConfig(8, 1))), "decode block_q=3"),
        (dict(config=KernelConfig(TileConfig(4, 1), TileConfig(8, 1))), "decode block_q \\* next_power_of_2"),
        (dict(config=KernelConfig(TileConfig(8, 1), TileConfig(8, 1), min_split_kv=0)), "positive"),
    ],
)
def test_validation_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        _call(**overrides)


def test_triton_only_constraints():
    args = _valid_args(d=80)
    ragged_paged_attention(**args, interpret=True)  # fine in interpret mode
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        ragged_paged_attention(**args, interpret=False)
    args = _valid_args(bs=24)
    with pytest.raises(ValueError, match="power-of-two block_size"):
        ragged_paged_attention(**args, interpret=False)


def test_traced_metadata_skips_value_checks_but_checks_shapes():
    args = _valid_args()
    bad = dict(args, kv_lens=jnp.array([65, 1, 0], jnp.int32))
    jax.jit(functools.partial(ragged_paged_attention, interpret=True)).trace(**bad)  # no value check
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        jax.jit(functools.partial(ragged_paged_attention, interpret=True)).trace(
            **dict(args, q=jnp.zeros((16, 3, 64), jnp.float32))
        )


# ---------------------------------------------------------------------------------------------------------
# Backend selection


def test_get_attention_fn():
    assert get_attention_fn("xla") is ragged_paged_attention_xla
    fn = get_attention_fn("pallas")
    assert fn.func is ragged_paged_attention
    assert fn.keywords["interpret"] is (jax.default_backend() == "cpu")
    assert get_attention_fn("pallas", interpret=True).keywords["interpret"] is True
    with pytest.raises(ValueError, match=r"\['xla', 'pallas', 'cpu'\]"):
        get_attention_fn("triton")
    if jax.default_backend() == "cpu":
        with pytest.raises(NotImplementedError):
            get_attention_fn("pallas", interpret=False)
    args = make_inputs(CONFIGS[0], Batch([2, 1], [0, 7]), seed=3)
    np.testing.assert_allclose(
        np.asarray(get_attention_fn("pallas")(*args))[:3], np.asarray(get_attention_fn("xla")(*args))[:3], rtol=1e-5, atol=1e-5
    )


# ---------------------------------------------------------------------------------------------------------
# GPU lowering on a CPU-only machine


@pytest.mark.parametrize(
    "dtype, hq, hkv, d, bs, max_blocks, kwargs",
    [
        # Mistral-7B heads, default (rule or table) config: prefill tiles, split decode tiles and the merge.
        ("bfloat16", 32, 8, 128, 16, 64, {}),
        # Long context: the split bound reaches 16.
        ("bfloat16", 32, 8, 128, 16, 1024, {}),
        ("float32", 8, 8, 64, 32, 32, dict(block_q=16)),
        # GQA group 7 (padded to 8), llama-1b-like head_dim 64.
        ("bfloat16", 28, 4, 128, 16, 32, {}),
        ("bfloat16", 32, 8, 64, 16, 256, {}),
        # Decode tiles written directly (no split), and decode tiles disabled.
        ("bfloat16", 32, 8, 128, 16, 64, dict(num_kv_splits=1)),
        ("float16", 32, 8, 128, 16, 64, dict(config=KernelConfig(TileConfig(0, 4), TileConfig(16, 4)))),
    ],
)
def test_lowers_for_gpu_through_triton(monkeypatch, dtype, hq, hkv, d, bs, max_blocks, kwargs):
    """Lowers the kernels for the "cuda" platform (no GPU needed): the Pallas Triton lowering runs every
    rule and builds the Triton (tt) MLIR modules (prefill tiles; decode tiles, split or direct; the merge),
    which must pass MLIR verification, and the StableHLO module carries them as `__gpu$xla.gpu.triton`
    custom calls. Triton-to-PTX compilation itself happens in XLA's GPU compiler, which needs a GPU build,
    so it is not exercised here."""
    from jax._src.pallas.triton import lowering as triton_lowering

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kw):
        result = original(*args, **kw)
        op = result.module.operation
        with op.context:
            modules.append((op.verify(), op.get_asm()))
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", capture)
    t, nb, s = 128, 256, 16
    dt = jnp.dtype(dtype)
    args = (
        jax.ShapeDtypeStruct((t, hq, d), dt),
        jax.ShapeDtypeStruct((nb, bs, hkv, d), dt),
        jax.ShapeDtypeStruct((nb, bs, hkv, d), dt),
        jax.ShapeDtypeStruct((s,), jnp.int32),
        jax.ShapeDtypeStruct((s, max_blocks), jnp.int32),
        jax.ShapeDtypeStruct((s + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    config, _ = resolve_kernel_config((t, hq, d), (nb, bs, hkv, d), (s, max_blocks), dt, **kwargs)
    fn = functools.partial(ragged_paged_attention, interpret=False, **kwargs)
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    expected = ["rpa_prefill"]
    if config.decode.block_q:
        expected += ["rpa_decode_split", "rpa_merge"] if config.max_splits > 1 else ["rpa_decode_bq"]
    assert text.count("__gpu$xla.gpu.triton") == len(expected)
    assert len(modules) == len(expected)
    g_pad = _next_pow2(hq // hkv)
    for name, (verified, asm) in zip(expected, modules):
        assert verified
        assert f"tt.func public @{name}" in asm
        if name == "rpa_merge":
            assert "tt.dot" not in asm and "scf.for" in asm  # a loop over the used splits
            continue
        # q k^T and p v, in the unmasked loop over fully visible KV steps and in the masked loop.
        assert asm.count("tt.dot") == 4
        assert asm.count("scf.for") == 2
        if dtype == "float32":
            # Full float32 (IEEE, the printer's default, so not spelled out) matmuls, not Triton's TF32 default.
            assert "tf32" not in asm
        tile = config.prefill if name == "rpa_prefill" else config.decode
        assert f"tensor<{tile.block_q * g_pad}x{d}x" in asm  # the GQA group is folded into one matrix
        if name == "rpa_decode_split":
            assert f"_split{config.max_splits}_" in asm
    if max_blocks == 1024 and not kwargs:
        assert config.max_splits == 16
