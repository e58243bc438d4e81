"""Fused projections: one matmul for q, k and v, one for the MLP's gate and up, in every decoder layer.

Two layouts of the same weights:

* the checkpoint layout: separate `q_proj`, `k_proj`, `v_proj` (and `gate_proj`, `up_proj`) modules, as Hugging
  Face stores them. HF conversion (`hf_param_plan`), converted Orbax folders, GGUF conversion and the seeded
  random draws (`random_init`, whose values are keyed by these paths) all use it;
* the serving layout, the Flax modules' own: `qkv_proj` and `gate_up_proj` (below), so a layer runs 4 weight
  matmuls instead of 7 (Falcon, whose MLP has no gate: 4 instead of 6).

`fuse_projections` turns the first into the second once, when the weights are loaded (`loader.load_model`,
`random_init.init_random_params`); `checkpoint_layout` maps a tree of the serving layout (shapes, logical axes)
back to the checkpoint's, so the readers check and place what they read.

    qkv_proj/kernel      [embed, kv_heads, q_per_kv + 2, head_dim]   logical axes (embed, kv_heads, qkv, head_dim)
    qkv_proj/bias        [kv_heads, q_per_kv + 2, head_dim]          (Qwen2, Falcon with `bias`)
    gate_up_proj/kernel  [embed, 2, mlp]                             logical axes (embed, gate_up, mlp)

For KV head g, slots 0 .. q_per_kv - 1 are query heads g * q_per_kv ... (HF's GQA grouping: query head h reads
KV head h // q_per_kv), slot q_per_kv is k and slot q_per_kv + 1 is v; this is also Falcon's own
`query_key_value` layout. Sharding the kv_heads axis over tensor-parallel devices keeps each device's query
heads with their KV head. With KV heads replicated over devices (`kv_replication` r, see `parallel.plan`) the
fused kernel is built for kv_heads * r heads: expanded head j holds KV head j // r and query heads
j * G' ... (j + 1) * G' - 1, G' = heads / (kv_heads * r).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

LogicalAxes = tuple[str | None, ...]


def split_qkv(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`[..., kv_heads, q_per_kv + 2, head_dim]` -> q `[..., heads, head_dim]`, k and v `[..., kv_heads, head_dim]`:
    the qkv projection's output, or its kernel or bias."""
    per_kv = x.shape[-2] - 2
    q = x[..., :per_kv, :].reshape(*x.shape[:-3], x.shape[-3] * per_kv, x.shape[-1])
    return q, x[..., per_kv, :], x[..., per_kv + 1, :]


def fuse_qkv(q: jax.Array, k: jax.Array, v: jax.Array, kv_replication: int = 1) -> jax.Array:
    """q `[..., heads, head_dim]`, k and v `[..., kv_heads, head_dim]` -> `[..., kv_heads * kv_replication,
    q_per_kv + 2, head_dim]` (q_per_kv = heads / (kv_heads * kv_replication)); inverse of `split_qkv` when
    kv_replication is 1."""
    groups = k.shape[-2] * kv_replication
    q = q.reshape(*q.shape[:-2], groups, q.shape[-2] // groups, q.shape[-1])
    k, v = (jnp.repeat(x, kv_replication, axis=-2)[..., None, :] for x in (k, v))
    return jnp.concatenate([q, k, v], axis=-2)


def split_gate_up(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`[..., 2, mlp]` -> gate, up `[..., mlp]`: the gate/up projection's output, or its kernel."""
    return x[..., 0, :], x[..., 1, :]


def fuse_gate_up(gate: jax.Array, up: jax.Array, kv_replication: int = 1) -> jax.Array:
    """gate, up `[..., mlp]` -> `[..., 2, mlp]` (`kv_replication` does not apply)."""
    del kv_replication
    return jnp.stack([gate, up], axis=-2)


@dataclasses.dataclass(frozen=True)
class Fusion:
    """One fused projection: serving module `name`, made of checkpoint modules `parts` (in slot order), which
    all have the same leaves (`kernel`, optional `bias`). Every leaf has its fused axis second to last."""

    name: str
    parts: tuple[str, ...]
    fuse: Callable[..., jax.Array]  # (*part leaves, kv_replication) -> fused leaf
    split: Callable[[jax.Array], tuple[jax.Array, ...]]  # fused leaf -> part leaves (kv_replication 1)
    part_axes: Callable[[LogicalAxes], tuple[LogicalAxes, ...]]  # fused leaf's logical axes -> each part's


QKV = Fusion(
    "qkv_proj", ("q_proj", "k_proj", "v_proj"), fuse_qkv, split_qkv,
    lambda axes: (axes[:-3] + ("heads", axes[-1]),) + (axes[:-2] + axes[-1:],) * 2,
)
GATE_UP = Fusion("gate_up_proj", ("gate_proj", "up_proj"), fuse_gate_up, split_gate_up,
                 lambda axes: (axes[:-2] + axes[-1:],) * 2)
FUSIONS = (QKV, GATE_UP)
_BY_NAME = {f.name: f for f in FUSIONS}


def fuse_projections(params: dict[str, Any], kv_replication: int = 1) -> dict[str, Any]:
    """Checkpoint layout -> serving layout, in place: wherever a dict holds all the parts of a fusion (in
    stacked `layers/...`, unrolled `layers_{i}/...` or pipeline-stage trees alike) they are replaced by the
    fused module. Returns `params`.

    Leaf by leaf, each part is dropped from `params` as soon as its fused leaf exists, so the separate arrays
    are freed as it goes (unless the caller holds other references to them): memory peaks at the weights plus
    one fused leaf (for stacked layers, all layers of one leaf). Each fused leaf is made by one jitted function
    on the devices of its first part (q, gate): a `NamedSharding` gains an unsharded fused axis (so q's heads
    sharding becomes the kv_heads sharding), and each device computes only its own shard."""
    for child in list(params.values()):
        if isinstance(child, dict):
            fuse_projections(child, kv_replication)
    for fusion in FUSIONS:
        if not all(part in params for part in fusion.parts):
            continue
        fused = {}
        for leaf in sorted(params[fusion.parts[0]]):
            parts = [params[part].pop(leaf) for part in fusion.parts]
            fused[leaf] = _fuse_fn(fusion, kv_replication, _fused_sharding(parts[0]))(*parts)
            del parts
        for part in fusion.parts:
            del params[part]
        params[fusion.name] = fused
    return params


def _fused_sharding(part: Any) -> Any:
    """The sharding of a fused leaf whose first part is `part`: a None (unsharded) fused axis inserted before the
    last axis of a `NamedSharding`; any other sharding as it is; None for host (numpy) arrays."""
    sharding = getattr(part, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (part.ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:-1], None, spec[-1]))


@functools.cache
def _fuse_fn(fusion: Fusion, kv_replication: int, sharding: Any) -> Callable[..., jax.Array]:
    """`fusion.fuse` jitted into `sharding` (None: where XLA puts it); one compile per leaf shape."""
    fuse = functools.partial(fusion.fuse, kv_replication=kv_replication)
    return jax.jit(fuse) if sharding is None else jax.jit(fuse, out_shardings=sharding)


def checkpoint_layout(tree: Any, split_leaf: Callable[[Fusion, Any], tuple[Any, ...]]) -> Any:
    """A tree of the serving layout (any leaves: shapes, logical axes) -> the checkpoint layout's: each fused
    module becomes its parts, each of its leaves split by `split_leaf(fusion, leaf)` (one value per part)."""
    if not isinstance(tree, dict):
        return tree
    out: dict[str, Any] = {}
    for key, child in tree.items():
        fusion = _BY_NAME.get(key)
        if fusion is None:
            out[key] = checkpoint_layout(child, split_leaf)
            continue
        for part in fusion.parts:
            out[part] = {}
        for leaf, value in child.items():
            for part, part_value in zip(fusion.parts, split_leaf(fusion, value)):
                out[part][leaf] = part_value
    return out


def checkpoint_shapes(shapes: Any) -> Any:
    """Serving-layout `jax.ShapeDtypeStruct` tree -> the checkpoint layout's."""
    return checkpoint_layout(shapes, lambda fusion, x: jax.eval_shape(fusion.split, x))


def checkpoint_logical_axes(axes: Any) -> Any:
    """Serving-layout tree of logical `PartitionSpec`s -> the checkpoint layout's."""
    return checkpoint_layout(axes, lambda fusion, spec: tuple(PartitionSpec(*a) for a in fusion.part_axes(tuple(spec))))
