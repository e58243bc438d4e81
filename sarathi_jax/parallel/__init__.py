"""Tensor and pipeline parallelism: mesh and stage plan, sharding rules, sharded loading, the model runner's
stages (`stages.py`), stage timing.

    plan = make_plan(model_config, tensor_parallel_size=2, pipeline_parallel_size=2)   # ValueError if impossible
    shardings = plan.param_shardings(for_loading=True)        # NamedSharding per checkpoint parameter leaf
    config, params = load_model(name, dtype, seed=seed, shardings=shardings, kv_replication=plan.kv_replication)
    runner = ModelRunner(model_config, params, engine_config, sizing, attention_fn=attention_fn, plan=plan)

See docs/parallelism.md.
"""

from sarathi_jax.parallel.distributed import initialize_distributed_from_env
from sarathi_jax.parallel.loading import load_model_config, load_parallel_model
from sarathi_jax.parallel.pipeline import MicrobatchRecord, PipelineTimeline
from sarathi_jax.parallel.plan import (
    LOGICAL_AXIS_RULES,
    PP_AXIS,
    TP_AXIS,
    ParallelPlan,
    make_mesh,
    make_plan,
    split_layers,
    validate_parallel_config,
)
from sarathi_jax.parallel.sharding import init_stage_kv_cache, per_device_bytes, place_params, shard_attention

__all__ = [
    "LOGICAL_AXIS_RULES",
    "PP_AXIS",
    "TP_AXIS",
    "MicrobatchRecord",
    "ParallelPlan",
    "PipelineTimeline",
    "init_stage_kv_cache",
    "initialize_distributed_from_env",
    "load_model_config",
    "load_parallel_model",
    "make_mesh",
    "make_plan",
    "per_device_bytes",
    "place_params",
    "shard_attention",
    "split_layers",
    "validate_parallel_config",
]
