"""The one factory of every engine an `EngineConfig` describes: real (`build_engine`: `LLMEngine`, or
`DisaggregatedEngine` with `config.disaggregation`) or simulated (`build_simulated_engine`: `SimulatedEngine`, or
`DisaggregatedSimEngine` with `config.disaggregation`).

All four size their KV cache and scheduler and set their token budget by one sequence,
`engine.token_budget.plan_engine`: the real engine inside `LLMEngine` (each instance of a disaggregated one is
an `LLMEngine`), the simulated ones here, with the simulator's cost model as the predictor. Engines are imported
when built, so that importing this module (as `sarathi_jax.llm` and the server do) loads none of them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sarathi_jax.config.disaggregation import KVLink
    from sarathi_jax.config.engine_config import EngineConfig
    from sarathi_jax.disagg.real_engine import DisaggregatedEngine
    from sarathi_jax.disagg.sim_engine import DisaggregatedSimEngine
    from sarathi_jax.engine.llm_engine import LLMEngine
    from sarathi_jax.engine.token_budget import EnginePlan
    from sarathi_jax.models.config import ModelConfig
    from sarathi_jax.sim.simulator import IterationCost, SimulatedEngine


def build_engine(config: EngineConfig, *, warmup: bool = True) -> LLMEngine | DisaggregatedEngine:
    """The real engine `config` asks for: disaggregated when `config.disaggregation` is set, else `LLMEngine`."""
    if config.disaggregation is not None:
        from sarathi_jax.disagg.real_engine import DisaggregatedEngine

        return DisaggregatedEngine(config, warmup=warmup)
    from sarathi_jax.engine.llm_engine import LLMEngine

    return LLMEngine(config, warmup=warmup)


def build_simulated_engine(config: EngineConfig, cost_model: IterationCost | None = None, *,
                           link: KVLink | None = None, serial_fraction: float = 0.0,
                           num_devices: int | None = None) -> SimulatedEngine | DisaggregatedSimEngine:
    """The simulated engine `config` asks for, sized like the real engine the same config would build: same
    scheduler settings, same number of KV blocks (from the model's shape and kv_cache_bytes unless num_blocks is
    given), same max_model_len rule, same token budget (`plan_engine`).

    `cost_model`: None for the simulator's default (it does not model this CPU), or a calibrated one; a
    `sim.cost_model.BucketCostModel` is given the token buckets the real engine would pad this configuration's
    batches to. token_budget "auto" / "dynamic" resolve with the same cost model (the simulator's default when
    None); `engine.budget_setup` says how. tensor_parallel_size N > 1: N simulated devices, the KV budget N
    times one device's and the cost model scaled by `device_cost` over `link` (default NVLink).

    With `config.disaggregation` ("P:D"): a `DisaggregatedSimEngine`, checked against `num_devices` (None: the
    split's own count) and the model's heads; each instance sized and priced as a colocated engine of its tensor
    parallelism (a device's KV budget per device), the KV cache moving over `link`. Fixed integer budgets only."""
    from sarathi_jax.config.disaggregation import KV_LINKS

    link = link or KV_LINKS["nvlink"]
    if config.disaggregation is not None:
        return _disaggregated_sim_engine(config, cost_model, link, serial_fraction, num_devices)
    from sarathi_jax.engine import token_budget
    from sarathi_jax.sim.simulator import CostModel, SimulatedEngine

    mc, tp = _model_config(config), config.tensor_parallel_size
    plan = _plan(config, mc, cost_model, link, serial_fraction, kv_devices=tp)
    if cost_model is not None or tp > 1:
        cost_model = device_cost(_padded(cost_model or CostModel(), plan), mc, _dtype(config), tp, link,
                                 serial_fraction)
    engine = SimulatedEngine(plan.sizing.scheduler_config, plan.sizing.num_blocks, config.block_size,
                             cost_model=cost_model, enable_prefix_caching=config.enable_prefix_caching)
    token_budget.install(plan.budget_setup, engine.scheduler, engine.iteration_log)
    engine.budget_setup = plan.budget_setup
    return engine


def _disaggregated_sim_engine(config: EngineConfig, cost_model: IterationCost | None, link: KVLink,
                              serial_fraction: float, num_devices: int | None) -> DisaggregatedSimEngine:
    from sarathi_jax.config.disaggregation import DisaggregationSplit
    from sarathi_jax.config.sizing import kv_bytes_per_block
    from sarathi_jax.disagg.sim_engine import DisaggregatedSimEngine
    from sarathi_jax.sim.simulator import CostModel

    split = DisaggregationSplit.parse(config.disaggregation)
    mc = _model_config(config)
    split.check(num_devices or split.num_devices, mc.num_attention_heads, mc.num_key_value_heads)
    if not isinstance(config.token_budget, int):
        raise ValueError(f"disaggregation: token_budget {config.token_budget!r} is not supported there yet; give "
                         "an integer budget")
    plan = _plan(config, mc, cost_model, link, serial_fraction, kv_devices=1)
    base, dtype = _padded(cost_model or CostModel(), plan), _dtype(config)
    return DisaggregatedSimEngine(
        split, plan.sizing.scheduler_config, plan.sizing.num_blocks,
        lambda tp: device_cost(base, mc, dtype, tp, link, serial_fraction), link=link,
        kv_bytes_per_token=kv_bytes_per_block(mc, 1, dtype), block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching)


def _plan(config: EngineConfig, mc: ModelConfig, cost_model: IterationCost | None, link: KVLink,
          serial_fraction: float, *, kv_devices: int) -> EnginePlan:
    """`plan_engine` for a simulated engine: the accelerator platform's buckets, a KV budget of `kv_devices`
    devices, and the cost model (the simulator's default when None) priced for the engine's devices as the
    budget's predictor."""
    from sarathi_jax.config.sizing import DEFAULT_KV_CACHE_BYTES, SIMULATOR_PLATFORM
    from sarathi_jax.engine import token_budget
    from sarathi_jax.sim.cost_model import BucketCostModel
    from sarathi_jax.sim.simulator import CostModel

    tp = config.tensor_parallel_size
    predictor = device_cost(cost_model or CostModel(), mc, _dtype(config), tp, link, serial_fraction)
    source = ((cost_model.source.get("path") or "--cost-model") if isinstance(cost_model, BucketCostModel)
              else "the simulator's default")
    kv_bytes = kv_devices * (config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES)
    return token_budget.plan_engine(config, mc, kv_bytes, SIMULATOR_PLATFORM, lambda buckets: (predictor, source))


def _padded(cost_model: IterationCost, plan: EnginePlan) -> IterationCost:
    """A `BucketCostModel` given the buckets the planned engine pads its batches to (the ladder of the platform it
    was calibrated on, when its source says: a CPU engine's 4, 8, 24, ... buckets; else `SIMULATOR_PLATFORM`'s);
    any other as it is."""
    from sarathi_jax.config.sizing import SIMULATOR_PLATFORM, bucket_ladder, platform_buckets
    from sarathi_jax.sim.cost_model import BucketCostModel

    if not isinstance(cost_model, BucketCostModel):
        return cost_model
    platform = (cost_model.source or {}).get("platform", SIMULATOR_PLATFORM)
    return cost_model.with_buckets(platform_buckets(plan.sizing.max_step_tokens, platform,
                                                    bucket_ladder(plan.config)))


def _dtype(config: EngineConfig) -> str:
    from sarathi_jax.config.engine_config import resolve_dtype

    return resolve_dtype(config.dtype, "cpu")


def _model_config(config: EngineConfig) -> ModelConfig:
    """The model's shape without its weights: an HF folder's config, or a preset's (as
    `parallel.loading.load_model_config`, which would load JAX: the simulator runs without it)."""
    if os.path.isdir(config.model):
        from sarathi_jax.models.config import ModelConfig

        return ModelConfig.from_pretrained(config.model)
    from sarathi_jax.models.presets import get_preset

    return get_preset(config.model)


def device_cost(cost_model: IterationCost, model_config: ModelConfig, dtype: str, tp: int, link: KVLink,
                serial_fraction: float = 0.0) -> IterationCost:
    """`cost_model` (one device's) for an instance of `tp` devices (`sim.tp_cost.TensorParallelCost`; as is
    for 1)."""
    from sarathi_jax.config.sizing import DTYPE_BYTES
    from sarathi_jax.sim.tp_cost import TensorParallelCost

    if tp == 1:
        return cost_model
    return TensorParallelCost(cost_model, tp, link, num_layers=model_config.num_hidden_layers,
                              hidden_size=model_config.hidden_size, bytes_per_value=DTYPE_BYTES[dtype],
                              serial_fraction=serial_fraction)

