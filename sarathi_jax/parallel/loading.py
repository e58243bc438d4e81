"""Restoring a model straight into its shards: each device receives only its part of each tensor.

`load_parallel_model` reads just the config first (the split is checked before any weight is read), then calls
`sarathi_jax.models.load_model(..., shardings=..., kv_replication=...)` with one target `NamedSharding` per
leaf of the checkpoint layout (each on its pipeline stage's sub-mesh). That loader places leaf by leaf: an HF
safetensors folder is streamed tensor by tensor and `device_put` with the leaf's sharding (host memory about
one tensor, no device ever holds a full copy of a sharded tensor), an Orbax folder (`checkpoints_convert`) is
restored shard by shard, and a preset's seeded weights are drawn on the devices, each device drawing its own
shards (`sarathi_jax.models.random_init`); then it fuses the q/k/v and gate/up projections on the same devices
(`sarathi_jax.models.fusion`), for the plan's KV heads. Stacked layer weights of a multi-stage pipeline are
staged in host memory first (see `ParallelPlan.param_shardings`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from sarathi_jax.models import ModelConfig, load_model
from sarathi_jax.models.loader import load_model_config


def load_parallel_model(
    name_or_path: str | os.PathLike[str],
    dtype: Any,
    seed: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    devices: Sequence[Any] | None = None,
    quantization: str | None = None,
) -> tuple[Any, ModelConfig, Any]:
    """`(plan, model_config, params)` for a parallel engine: start multi-host JAX if the SARATHI_* variables
    ask for it, read the config, check the split (ValueError before any weight is read), then restore the
    weights straight into their shards and fuse them. `params` are those of `plan.model_config` (replicated KV
    heads already expanded in the fused q/k/v kernel); `place_params` splits them over the stages. `devices`: the
    mesh's (default: the first tp x pp of `jax.devices()`). `quantization`: as `load_model`'s (the scales are
    sharded with their output channels)."""
    from sarathi_jax.parallel.distributed import initialize_distributed_from_env
    from sarathi_jax.parallel.plan import make_plan

    initialize_distributed_from_env()
    config = load_model_config(name_or_path, quantization)
    plan = make_plan(config, tensor_parallel_size, pipeline_parallel_size, devices)
    loaded_config, params = load_model(
        name_or_path, dtype, seed=seed, shardings=plan.param_shardings(for_loading=True),
        kv_replication=plan.kv_replication, quantization=config.quantization,
    )
    assert loaded_config == config
    return plan, config, params
