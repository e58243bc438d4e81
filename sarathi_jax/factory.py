"""Engines the bench builds from an EngineConfig: LLMEngine or DisaggregatedEngine (real, --disaggregation P:D),
SimulatedEngine (--simulate) and DisaggregatedSimEngine (--simulate --disaggregation P:D)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sarathi_jax.config.engine_config import EngineConfig
    from sarathi_jax.disagg.real_engine import DisaggregatedEngine
    from sarathi_jax.engine.llm_engine import LLMEngine
    from sarathi_jax.disagg.sim_engine import DisaggregatedSimEngine
    from sarathi_jax.config.disaggregation import KVLink
    from sarathi_jax.models.config import ModelConfig
    from sarathi_jax.sim.simulator import IterationCost, SimulatedEngine


def make_llm_engine(config: EngineConfig) -> LLMEngine | DisaggregatedEngine:
    """The real engine `config` asks for: `LLMEngine`, or `DisaggregatedEngine` with `config.disaggregation`."""
    from sarathi_jax.disagg.real_engine import build_engine

    engine = build_engine(config)
    engine.wait_until_compiled()  # nothing is timed while background threads still compile
    return engine


def _model_config(config: EngineConfig) -> ModelConfig:
    import os

    if os.path.isdir(config.model):
        from sarathi_jax.models.config import ModelConfig

        return ModelConfig.from_pretrained(config.model)
    from sarathi_jax.models.presets import get_preset

    return get_preset(config.model)


def device_cost(cost_model: IterationCost, model_config: ModelConfig, dtype: str, tp: int, link: KVLink,
                serial_fraction: float = 0.0) -> IterationCost:
    """`cost_model` (one device's) for an instance of `tp` devices (`tp_cost.TensorParallelCost`; as is for 1)."""
    from sarathi_jax.config.sizing import DTYPE_BYTES
    from sarathi_jax.sim.tp_cost import TensorParallelCost

    if tp == 1:
        return cost_model
    return TensorParallelCost(cost_model, tp, link, num_layers=model_config.num_hidden_layers,
                              hidden_size=model_config.hidden_size, bytes_per_value=DTYPE_BYTES[dtype],
                              serial_fraction=serial_fraction)


def simulated_buckets(max_step_tokens: int, config: EngineConfig) -> tuple[int, ...]:
    """The buckets a simulated engine pads to: the real engine's rule (`sizing.platform_buckets`, the config's
    ladder) for the simulator's accelerator platform."""
    from sarathi_jax.config.sizing import SIMULATOR_PLATFORM, bucket_ladder, platform_buckets

    return platform_buckets(max_step_tokens, SIMULATOR_PLATFORM, bucket_ladder(config))


def make_simulated_engine(config: EngineConfig, cost_model: IterationCost | None = None, *,
                          link: KVLink | None = None, serial_fraction: float = 0.0) -> SimulatedEngine:
    """A SimulatedEngine sized like the LLMEngine that `config` would build: same scheduler settings, same
    number of KV blocks (from the model's shape and kv_cache_bytes unless num_blocks is given), same
    max_model_len rule. `cost_model`: None for the simulator's default (it does not model this CPU), or a
    calibrated one; a `sarathi_jax.sim.cost_model.BucketCostModel` is given the token buckets the real engine would
    pad this configuration's batches to. token_budget "auto" / "dynamic" resolve with the same cost model (the
    simulator's default when None); `engine.budget_setup` says how. tensor_parallel_size N > 1: N simulated
    devices, the KV budget N times one device's and the cost model scaled by `device_cost` over `link`
    (default NVLink)."""
    from sarathi_jax.config.engine_config import resolve_dtype
    from sarathi_jax.sim.cost_model import BucketCostModel
    from sarathi_jax.config.disaggregation import KV_LINKS
    from sarathi_jax.sim.simulator import SimulatedEngine
    from sarathi_jax.config.sizing import DEFAULT_KV_CACHE_BYTES, size_engine

    mc = _model_config(config)
    from sarathi_jax.engine import token_budget
    from sarathi_jax.sim.simulator import CostModel

    tp, dtype = config.tensor_parallel_size, resolve_dtype(config.dtype, "cpu")
    predictor = device_cost(cost_model or CostModel(), mc, dtype, tp, link or KV_LINKS["nvlink"], serial_fraction)
    top_buckets = simulated_buckets(config.budget_ceiling, config)
    source = ((cost_model.source.get("path") or "--cost-model") if isinstance(cost_model, BucketCostModel)
              else "the simulator's default")
    # "auto": the engine is sized for its pick; "dynamic": it pads to the ladder compiled for max_token_budget.
    kv_bytes = tp * (config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES)
    top_len = size_engine(dataclasses.replace(config, token_budget=config.budget_ceiling), mc, kv_cache_bytes=kv_bytes)
    config, setup = token_budget.resolve(config, predictor, source,
                                         top_buckets if config.token_budget == "dynamic" else None,
                                         max_model_len=top_len.max_model_len)
    sizing = size_engine(config, mc, kv_cache_bytes=kv_bytes)
    if isinstance(cost_model, BucketCostModel):
        cost_model = cost_model.with_buckets(simulated_buckets(sizing.max_step_tokens, config))
    if cost_model is not None or tp > 1:
        cost_model = device_cost(cost_model or CostModel(), mc, dtype, tp, link or KV_LINKS["nvlink"], serial_fraction)
    engine = SimulatedEngine(sizing.scheduler_config, sizing.num_blocks, config.block_size, cost_model=cost_model,
                             enable_prefix_caching=config.enable_prefix_caching)
    token_budget.install(setup, engine.scheduler, engine.clock.now)
    engine.budget_setup = setup
    return engine


def make_disaggregated_engine(config: EngineConfig, cost_model: IterationCost | None = None, *,
                              link: KVLink | None = None, serial_fraction: float = 0.0,
                              num_devices: int | None = None) -> DisaggregatedSimEngine:
    """A `DisaggregatedSimEngine` for `config.disaggregation` ("P:D"), checked against `num_devices` (None: the
    split's own count) and the model's heads. Each instance is sized and priced as `make_simulated_engine`
    sizes and prices one of its tensor parallelism (a device's KV budget per device), the KV cache moves over
    `link` (default NVLink). Fixed integer token budgets only."""
    from sarathi_jax.config.engine_config import resolve_dtype
    from sarathi_jax.sim.cost_model import BucketCostModel
    from sarathi_jax.disagg.sim_engine import DisaggregatedSimEngine
    from sarathi_jax.config.disaggregation import KV_LINKS, DisaggregationSplit
    from sarathi_jax.sim.simulator import CostModel
    from sarathi_jax.config.sizing import kv_bytes_per_block, size_engine

    split = DisaggregationSplit.parse(config.disaggregation)
    mc = _model_config(config)
    split.check(num_devices or split.num_devices, mc.num_attention_heads, mc.num_key_value_heads)
    if not isinstance(config.token_budget, int):
        raise ValueError(f"disaggregation: token_budget {config.token_budget!r} is not supported there yet; give "
                         "an integer budget")
    sizing, dtype, link = size_engine(config, mc), resolve_dtype(config.dtype, "cpu"), link or KV_LINKS["nvlink"]
    base = cost_model or CostModel()
    if isinstance(base, BucketCostModel):
        base = base.with_buckets(simulated_buckets(sizing.max_step_tokens, config))
    return DisaggregatedSimEngine(
        split, sizing.scheduler_config, sizing.num_blocks,
        lambda tp: device_cost(base, mc, dtype, tp, link, serial_fraction), link=link,
        kv_bytes_per_token=kv_bytes_per_block(mc, 1, dtype), block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching)
