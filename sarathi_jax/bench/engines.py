"""Engines the bench builds from an EngineConfig: LLMEngine (real) and SimulatedEngine (--simulate)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sarathi_jax.config import EngineConfig
    from sarathi_jax.engine import LLMEngine
    from sarathi_jax.simulator import IterationCost, SimulatedEngine


def make_llm_engine(config: EngineConfig) -> LLMEngine:
    from sarathi_jax.engine import LLMEngine

    engine = LLMEngine(config)
    engine.wait_until_compiled()  # nothing is timed while background threads still compile
    return engine


def make_simulated_engine(config: EngineConfig, cost_model: IterationCost | None = None) -> SimulatedEngine:
    """A SimulatedEngine sized like the LLMEngine that `config` would build: same scheduler settings, same
    number of KV blocks (from the model's shape and kv_cache_bytes unless num_blocks is given), same
    max_model_len rule. `cost_model`: None for the simulator's default (it does not model this CPU), or a
    calibrated one; a `sarathi_jax.cost_model.BucketCostModel` is given the token buckets the real engine would
    pad this configuration's batches to. token_budget "auto" / "dynamic" resolve with the same cost model (the
    simulator's default when None); `engine.budget_setup` says how."""
    import os

    from sarathi_jax.cost_model import BucketCostModel
    from sarathi_jax.simulator import SimulatedEngine
    from sarathi_jax.sizing import size_engine

    if os.path.isdir(config.model):
        from sarathi_jax.models.config import ModelConfig

        mc = ModelConfig.from_pretrained(config.model)
    else:
        from sarathi_jax.models.presets import get_preset

        mc = get_preset(config.model)
    from sarathi_jax import token_budget
    from sarathi_jax.simulator import CostModel
    from sarathi_jax.sizing import token_buckets

    predictor = cost_model or CostModel()
    top_buckets = token_buckets(config.budget_ceiling)
    source = (predictor.source.get("path") or "--cost-model") if isinstance(predictor, BucketCostModel) else "the simulator's default"
    # "auto": the engine is sized for its pick; "dynamic": it pads to the ladder compiled for max_token_budget.
    config, setup = token_budget.resolve(config, predictor, source,
                                         top_buckets if config.token_budget == "dynamic" else None)
    sizing = size_engine(config, mc)
    if isinstance(cost_model, BucketCostModel):
        cost_model = cost_model.with_buckets(token_buckets(sizing.max_step_tokens))
    engine = SimulatedEngine(sizing.scheduler_config, sizing.num_blocks, config.block_size, cost_model=cost_model,
                             enable_prefix_caching=config.enable_prefix_caching)
    token_budget.install(setup, engine.scheduler)
    engine.budget_setup = setup
    return engine
