"""How an `EngineConfig` sizes an engine for a model: KV blocks, max_model_len, scheduler limits, buckets.

Plain Python (no JAX), so the real engine and the simulator size themselves by the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_jax.config import EngineConfig
from sarathi_jax.models.config import ModelConfig
from sarathi_jax.scheduler import SchedulerConfig
from sarathi_jax.scheduler.config import WHOLE_PROMPT_POLICIES

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# Policies that split prompts into chunks under the token budget; the others put whole prompts in a batch.
CHUNKING_POLICIES = ("sarathi", "simple_chunking", "chunked_prefills_only")


@dataclass(frozen=True)
class EngineSizing:
    num_blocks: int
    max_model_len: int
    scheduler_config: SchedulerConfig
    max_step_tokens: int  # the largest batch the scheduler can build: the top compiled bucket


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: str) -> int:
    mc = model_config
    return 2 * mc.num_hidden_layers * block_size * mc.num_key_value_heads * mc.head_dim * _DTYPE_BYTES[dtype]


def size_engine(config: EngineConfig, model_config: ModelConfig) -> EngineSizing:
    """Raises ValueError when max_model_len exceeds what the model computes exactly."""
    num_blocks = config.num_blocks or max(
        1, config.kv_cache_bytes // kv_bytes_per_block(model_config, config.block_size, config.dtype)
    )
    model_limit = model_config.max_model_len  # attention here is full: stay inside a sliding window
    if config.max_model_len is not None and config.max_model_len > model_limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {model_limit} tokens")
    default_len = model_limit
    if config.scheduler in WHOLE_PROMPT_POLICIES and config.max_num_batched_tokens is not None:
        # These policies never split a prompt: a batch must hold the longest one. An explicit batch limit
        # bounds the default length rather than being refused by it.
        default_len = min(default_len, config.max_num_batched_tokens)
    max_model_len = min(config.max_model_len or default_len, num_blocks * config.block_size)
    scheduler_config = SchedulerConfig(
        policy=config.scheduler,
        token_budget=config.token_budget,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        tile_size=config.tile_size,
        watermark=config.watermark,
    )
    if config.scheduler in CHUNKING_POLICIES:
        max_step_tokens = config.token_budget
    else:
        max_step_tokens = max(config.token_budget, config.max_num_batched_tokens or max_model_len)
    return EngineSizing(num_blocks, max_model_len, scheduler_config, max_step_tokens)
