"""Engines the bench builds from an EngineConfig: LLMEngine (real) and SimulatedEngine (--simulate)."""

from __future__ import annotations

from typing import Any

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def make_llm_engine(config: Any) -> Any:
    from sarathi_jax.engine import LLMEngine

    return LLMEngine(config)


# Policies whose batches never exceed the token budget (as in sarathi_jax.engine): the runner's largest
# bucket is the budget; the others' is max(budget, max_num_batched_tokens or max_model_len).
_CHUNKING_POLICIES = ("sarathi", "simple_chunking", "chunked_prefills_only")


def make_simulated_engine(config: Any, cost_model: Any = None) -> Any:
    """A SimulatedEngine sized like the LLMEngine that `config` would build: same scheduler settings, same
    number of KV blocks (from the model's shape and kv_cache_bytes unless num_blocks is given), same
    max_model_len rule. `cost_model`: None for the simulator's default (it does not model this CPU), or a
    calibrated one such as `step_cost.BucketCostModel`; one with `with_buckets` is given the token buckets
    the real engine would pad this configuration's batches to."""
    from sarathi_jax.simulator import SimulatedEngine

    for name in ("from_engine_config", "from_config"):
        ctor = getattr(SimulatedEngine, name, None)
        if callable(ctor) and cost_model is None:
            return ctor(config)

    import os

    from sarathi_jax.scheduler import SchedulerConfig

    if os.path.isdir(config.model):
        from sarathi_jax.models.config import ModelConfig

        mc = ModelConfig.from_pretrained(config.model)
    else:
        from sarathi_jax.models.presets import get_preset

        mc = get_preset(config.model)
    per_block = 2 * mc.num_hidden_layers * config.block_size * mc.num_key_value_heads * mc.head_dim * _DTYPE_BYTES[config.dtype]
    num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // per_block)
    model_limit = mc.max_model_len
    if config.max_model_len is not None and config.max_model_len > model_limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {model_limit} tokens")
    max_model_len = min(config.max_model_len or model_limit, num_blocks * config.block_size)
    sc = SchedulerConfig(
        policy=config.scheduler,
        token_budget=config.token_budget,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        tile_size=config.tile_size,
        watermark=config.watermark,
    )
    if cost_model is not None and callable(getattr(cost_model, "with_buckets", None)):
        from sarathi_jax.model_runner import token_buckets

        if config.scheduler in _CHUNKING_POLICIES:
            max_step_tokens = config.token_budget
        else:
            max_step_tokens = max(config.token_budget, config.max_num_batched_tokens or max_model_len)
        cost_model = cost_model.with_buckets(token_buckets(max_step_tokens))
    return SimulatedEngine(sc, num_blocks, config.block_size, cost_model=cost_model)
