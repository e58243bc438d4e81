"""`sarathi_jax.sizing`: token buckets and padding, KV bytes per block, the engine's sizing by policy, and that
the module (with the simulator's cost model built on it) imports no JAX. KV budgets from device memory are
in test_config_defaults.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sarathi_jax.config import EngineConfig
from sarathi_jax.models.presets import get_preset
from sarathi_jax.sizing import DTYPE_BYTES, bucket_for, kv_bytes_per_block, platform_buckets, size_engine, token_buckets


def test_token_buckets_are_powers_of_two_then_the_rounded_budget():
    assert token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert token_buckets(100) == (16, 32, 64, 112)  # the top is rounded up to a multiple of 16
    assert token_buckets(16) == (16,) and token_buckets(1) == (16,)
    assert token_buckets(40, smallest=8) == (8, 16, 32, 40)


def test_a_cpu_gets_buckets_halfway_between_the_powers_of_two_from_96():
    assert platform_buckets(512, "cpu") == (4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)
    assert platform_buckets(512, "gpu") == token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert platform_buckets(64, "cpu") == (4, 8, 16, 32, 64)  # below 96: powers of two only
    # A midpoint only where it saves a quarter of the top or more (not 96 beside a top of 100).
    assert platform_buckets(100, "cpu") == (4, 8, 16, 32, 64, 100)
    assert platform_buckets(200, "cpu") == (4, 8, 16, 32, 64, 96, 128, 200)
    assert bucket_for(platform_buckets(512, "cpu"), 300) == 384  # 1.28x padding, not 1.7x


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
    code = ("import sys, sarathi_jax.sizing, sarathi_jax.cost_model, sarathi_jax.simulator; "
            "print(sorted(m for m in ('jax', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_cpu_gets_small_buckets_and_accelerators_tile_sized_ones():
    from sarathi_jax.sizing import smallest_bucket

    assert smallest_bucket("cpu") == 4 and token_buckets(64, smallest_bucket("cpu")) == (4, 8, 16, 32, 64)
    for platform in ("gpu", "cuda", "rocm", "tpu"):
        assert token_buckets(64, smallest_bucket(platform)) == (16, 32, 64)
