"""Placing parameters and KV caches on a plan's meshes, and running attention per shard with `shard_map`."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sarathi_jax.models import kv_cache_shape
from sarathi_jax.parallel.plan import TP_AXIS, ParallelPlan

_Q_SPEC = PartitionSpec(None, TP_AXIS, None)  # [T, heads, head_dim]
_KV_SPEC = PartitionSpec(None, None, TP_AXIS, None)  # one layer's view: [blocks, block_size, kv_heads, head_dim]
_REPLICATED = PartitionSpec()


def shard_attention(attention_fn: Callable[..., jax.Array], mesh: Mesh) -> Callable[..., jax.Array]:
    """`attention_fn` (xla or Pallas, the `ragged_paged_attention_xla` signature) run once per TP shard under
    `shard_map`: each device sees its local q heads `[T, heads / tp, head_dim]` and the KV pages of its
    local KV heads; the batch metadata is replicated. The GQA grouping is preserved shard by shard because
    query heads and KV heads are split into the same number of contiguous blocks. No communication."""

    def attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale=None):
        local = functools.partial(attention_fn, sm_scale=sm_scale)
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(_Q_SPEC, _KV_SPEC, _KV_SPEC, _REPLICATED, _REPLICATED, _REPLICATED, _REPLICATED),
            out_specs=_Q_SPEC,
            check_vma=False,  # the kernels use pallas_call / while loops that carry no varying-axis info
        )(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)

    return attention


def place_params(params: Any, plan: ParallelPlan) -> list[dict]:
    """Split the full parameter tree of `plan.model_config` (as `load_parallel_model` returns it: fused, with
    any replicated KV heads already expanded) into one tree per stage, each leaf `device_put` to its target
    `NamedSharding` on its stage's sub-mesh, leaf by leaf (a host array sends each device only its shard;
    an array already placed so is left alone). A stacked layer parameter (`layers/...`) is cut along its
    layers axis: each stage gets the slice of its layer range. A tied embedding is copied from stage 0 to
    the last stage."""
    stages: list[dict] = [{} for _ in range(plan.num_stages)]
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    spec_of = _by_path(plan.param_specs())
    for key_path, full_leaf in flat:
        path = tuple(k.key for k in key_path)
        if path not in spec_of:
            raise ValueError(f"unexpected parameter {'/'.join(path)}")
        owner = plan.stage_of(path)
        for stage in range(plan.num_stages) if owner is None else (owner,):
            leaf = full_leaf
            if owner is None:  # host-staged stacked layers (see ParallelPlan.param_shardings): this stage's slice
                start, end = plan.layer_ranges[stage]
                leaf = np.asarray(full_leaf)[start:end]
            node = stages[stage]
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = jax.device_put(leaf, NamedSharding(plan.stage_mesh(stage), spec_of[path]))
    if plan.model_config.tie_word_embeddings and plan.num_stages > 1:
        last, name = plan.num_stages - 1, plan.embedding_name
        stages[last][name] = jax.device_put(stages[0][name], NamedSharding(plan.stage_mesh(last), spec_of[(name,)]))
    return stages


def _by_path(tree: Any) -> dict[tuple[str, ...], PartitionSpec]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    return {tuple(k.key for k in path): spec for path, spec in flat}


def init_stage_kv_cache(plan: ParallelPlan, stage: int, num_blocks: int, block_size: int, dtype: Any) -> tuple:
    """The zero stacked KV cache `(k_pages, v_pages)` of one stage's layers, created sharded over KV heads
    (each device allocates only its shard)."""
    start, end = plan.layer_ranges[stage]
    shape = kv_cache_shape(plan.model_config, num_blocks, block_size, num_layers=end - start)
    sharding = plan.kv_cache_sharding(stage)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return zeros(), zeros()


def per_device_bytes(tree: Any) -> dict[Any, int]:
    """Bytes held on each device by the arrays of `tree`, from their addressable shards."""
    usage: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            usage[shard.device] = usage.get(shard.device, 0) + shard.data.nbytes
    return usage
