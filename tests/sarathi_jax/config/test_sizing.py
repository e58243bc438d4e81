"""`sarathi_jax.config.sizing`: token buckets and padding, KV bytes per block, the engine's sizing by policy, and that
the module (with the simulator's cost model built on it) imports no JAX. KV budgets from device memory are
in test_config_defaults.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.models.presets import get_preset
from sarathi_jax.config.sizing import (
    DTYPE_BYTES,
    FINE_EVERY_STEP_UNTIL,
    FINE_GROWTH,
    FINE_STEP,
    bucket_for,
    bucket_ladder,
    kv_bytes_per_block,
    platform_buckets,
    size_engine,
    token_buckets,
)


def test_token_buckets_are_powers_of_two_then_the_rounded_budget():
    assert token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert token_buckets(100) == (16, 32, 64, 112)  # the top is rounded up to a multiple of 16
    assert token_buckets(16) == (16,) and token_buckets(1) == (16,)
    assert token_buckets(40, smallest=8) == (8, 16, 32, 40)


def test_a_cpu_gets_buckets_halfway_between_the_powers_of_two_from_24():
    assert platform_buckets(512, "cpu") == (4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert platform_buckets(512, "gpu") == token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert platform_buckets(16, "cpu") == (4, 8, 16)  # below 24: powers of two only
    # A midpoint only where it saves a quarter of the top or more (not 96 beside a top of 100).
    assert platform_buckets(100, "cpu") == (4, 8, 16, 24, 32, 48, 64, 100)
    assert platform_buckets(200, "cpu") == (4, 8, 16, 24, 32, 48, 64, 96, 128, 200)
    assert platform_buckets(64, "cpu") == (4, 8, 16, 24, 32, 48, 64)
    assert bucket_for(platform_buckets(512, "cpu"), 300) == 384  # 1.28x padding, not 1.7x


def test_the_fine_ladder_by_hand():
    assert platform_buckets(1024, "gpu", "fine") == (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 240, 288, 352,
                                                     432, 528, 656, 816, 1024)
    assert platform_buckets(256, "cpu", "fine") == (4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256)
    assert platform_buckets(80, "cpu", "fine") == (4, 8, 16, 32, 48, 64, 80)
    assert platform_buckets(100, "gpu", "fine") == (16, 32, 48, 64, 80, 96, 112)  # the top: a multiple of 16
    assert bucket_for(platform_buckets(1024, "gpu", "fine"), 80) == 80  # not 128 (section 15's case)
    with pytest.raises(ValueError, match="bucket ladder must be 'coarse' or 'fine'"):
        platform_buckets(64, "cpu", "finest")


@given(st.integers(1, 8192), st.sampled_from(["cpu", "gpu", "tpu"]))
def test_the_fine_ladder_rule(max_step_tokens, platform):
    """Ascending; the top holds max_step_tokens (rounded up to the smallest bucket); below FINE_STEP only the
    platform's powers of two, then multiples of FINE_STEP: every one up to FINE_EVERY_STEP_UNTIL, then each at
    most FINE_GROWTH x the one below (the top at most FINE_STEP more), so a batch pads by less than a tile or
    by FINE_GROWTH; and it is the ladder the config asks for."""
    fine = platform_buckets(max_step_tokens, platform, "fine")
    coarse = platform_buckets(max_step_tokens, platform)
    assert list(fine) == sorted(set(fine))
    assert fine[-1] == coarse[-1] >= max_step_tokens and fine[0] == coarse[0]
    tiles = [b for b in fine[:-1] if b >= FINE_STEP]
    assert all(b % FINE_STEP == 0 for b in tiles)
    assert [b for b in fine if b < FINE_STEP] == [b for b in coarse if b < FINE_STEP]
    assert set(range(FINE_STEP, min(FINE_EVERY_STEP_UNTIL, fine[-1]) + 1, FINE_STEP)) <= set(fine) | {fine[-1]}
    for lo, hi in zip(fine, fine[1:]):
        if lo >= FINE_EVERY_STEP_UNTIL:
            assert hi <= lo * FINE_GROWTH + (FINE_STEP if hi == fine[-1] else 0)
    for n in range(FINE_STEP, fine[-1] + 1, 7):  # padding: to the next tile up to 128, then by 1.25x at most
        padded = bucket_for(fine, n)
        assert padded <= (-(-n // FINE_STEP) * FINE_STEP if n <= FINE_EVERY_STEP_UNTIL else n * FINE_GROWTH + FINE_STEP)
    config = EngineConfig(token_budget="dynamic", slo_tbt_s=0.1)
    assert bucket_ladder(config) == "fine" and bucket_ladder(EngineConfig(token_budget=64)) == "coarse"
    assert bucket_ladder(EngineConfig(token_budget="auto", slo_tbt_s=0.1)) == "coarse"
    assert bucket_ladder(EngineConfig(token_budget=64, bucket_ladder="fine")) == "fine"
    assert bucket_ladder(EngineConfig(token_budget="dynamic", slo_tbt_s=0.1, bucket_ladder="coarse")) == "coarse"


def test_a_bad_bucket_ladder_is_refused():
    with pytest.raises(ValueError, match="bucket_ladder must be one of"):
        EngineConfig(bucket_ladder="powers")


def test_bucket_for_pads_to_the_smallest_bucket_that_holds_the_batch():
    buckets = token_buckets(100)
    assert [bucket_for(buckets, n) for n in (1, 16, 17, 64, 65, 112)] == [16, 16, 32, 64, 112, 112]
    assert bucket_for(buckets, 113) is None  # past the largest bucket


def test_kv_bytes_per_block_by_hand():
    mc = get_preset("tiny-llama")  # 4 layers, 2 KV heads of 64
    assert kv_bytes_per_block(mc, 16, "float32") == 2 * 4 * 16 * 2 * 64 * 4
    assert kv_bytes_per_block(mc, 16, "bfloat16") == kv_bytes_per_block(mc, 16, "float32") // 2
    assert DTYPE_BYTES == {"float32": 4, "bfloat16": 2}


@pytest.mark.parametrize("policy, max_step_tokens", [("sarathi", 128), ("vllm", 1024), ("orca", 1024)])
def test_size_engine_by_policy(policy, max_step_tokens):
    mc = get_preset("tiny-llama")
    config = EngineConfig(model="tiny-llama", dtype="float32", scheduler=policy, token_budget=128,
                          max_model_len=1024, kv_cache_bytes=64 * kv_bytes_per_block(mc, 16, "float32"))
    sizing = size_engine(config, mc)
    assert sizing.num_blocks == 64
    assert sizing.max_model_len == 1024  # not capped: 64 blocks of 16 hold exactly 1024 tokens
    # chunking policies never batch more than the budget; whole-prompt ones must fit the longest prompt
    assert sizing.max_step_tokens == max_step_tokens
    assert sizing.scheduler_config.policy == policy and sizing.scheduler_config.max_model_len == 1024
    small = size_engine(EngineConfig(model="tiny-llama", dtype="float32", scheduler=policy, token_budget=128,
                                     num_blocks=8), mc)
    assert (small.num_blocks, small.max_model_len) == (8, 8 * 16)  # the KV cache bounds max_model_len


def test_sizing_and_the_bucket_cost_model_import_no_jax():
    code = ("import sys, sarathi_jax.config.sizing, sarathi_jax.sim.cost_model, sarathi_jax.sim.simulator; "
            "print(sorted(m for m in ('jax', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_cpu_gets_small_buckets_and_accelerators_tile_sized_ones():
    from sarathi_jax.config.sizing import smallest_bucket

    assert smallest_bucket("cpu") == 4 and token_buckets(64, smallest_bucket("cpu")) == (4, 8, 16, 32, 64)
    for platform in ("gpu", "cuda", "rocm", "tpu"):
        assert token_buckets(64, smallest_bucket(platform)) == (16, 32, 64)
