"""How a model is laid out over devices: the ("pp", "tp") mesh, the pipeline stages and the sharding rules.

`make_plan(model_config, tensor_parallel_size, pipeline_parallel_size)` checks the configuration (a clear
ValueError when it cannot work) and returns a `ParallelPlan`:

* the mesh has shape `(pp, tp)` and axis names `("pp", "tp")`; row `s` of it is stage `s`'s sub-mesh, a 1-D
  mesh with the single axis `"tp"`: every stage is itself tensor parallel over its own `tp` devices;
* layers are split into `pp` contiguous stages, as evenly as possible (earlier stages take the extra layer);
  a stage holds its slice of the stacked layer parameters (`layers/...`, leading layers axis) and of the
  stacked KV cache; stage 0 also owns the embedding, the last stage the final norm, the LM head (a copy of
  the embedding when it is tied) and the sampler;
* logical axis names (see `sarathi_jax.models.llama`) map to mesh axes with `LOGICAL_AXIS_RULES`, Megatron
  style: KV heads (with their query heads, one fused q/k/v kernel `[embed, kv_heads, q_per_kv + 2, head_dim]`)
  and MLP columns are split over `"tp"` (so qkv_proj and gate_up_proj are column-parallel, o_proj and
  down_proj row-parallel with one all-reduce each); the vocabulary axis of the embedding and the LM head too,
  when it divides (vocab-parallel embedding and LM head; otherwise both stay replicated); `embed`,
  `head_dim` and the fused axes (`qkv`, `gate_up`) stay whole. The paged KV cache is sharded over KV heads like
  qkv_proj. Checkpoints hold separate q/k/v and gate/up (`sarathi_jax.models.fusion`): they are read into the
  same split (q over `heads`) and fused on the devices, each device making its own shard.

KV heads fewer than `tp` (strategy chosen: replicate). When `tp % num_key_value_heads == 0` each KV head is
replicated `tp // num_key_value_heads` times (as vLLM does): the runner's model gets
`num_key_value_heads = tp`, the fused q/k/v kernel is built for these KV heads when it is loaded (k/v repeated
head by head), and each device then holds one KV head and the query heads of its GQA group. Per-device KV
memory is then 1/kv_heads of the single-device figure, not 1/tp. Any other mismatch (heads or MLP width not
divisible by tp, KV heads neither a multiple nor a divisor of tp, more stages than layers, more devices than
exist) is a ValueError.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sarathi_jax.models import KV_CACHE_AXES, ModelConfig, checkpoint_param_logical_axes, param_logical_axes

PP_AXIS = "pp"
TP_AXIS = "tp"

# Logical axis name -> mesh axis (None: replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("heads", TP_AXIS),
    ("kv_heads", TP_AXIS),
    ("mlp", TP_AXIS),
    ("vocab", TP_AXIS),
    ("embed", None),
    ("head_dim", None),
    ("qkv", None),  # the fused q/k/v slots of a KV head (sarathi_jax.models.fusion)
    ("gate_up", None),
    ("layers", None),
)


def split_layers(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous `(start, end)` layer ranges, sizes differing by at most one (earlier stages larger)."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return tuple(ranges)


# Logical axes of the input embedding table (Llama's `embed_tokens`, Falcon's `word_embeddings`).
EMBEDDING_AXES = PartitionSpec("vocab", "embed")


def embedding_param_name(config: ModelConfig) -> str:
    """The top-level name of the input embedding (the parameter with logical axes ("vocab", "embed") that is
    not the untied LM head, which has the same axes)."""
    axes = param_logical_axes(config)
    return next(name for name, spec in axes.items() if spec == EMBEDDING_AXES and name != "lm_head")


# Top-level name of the stacked decoder-layer parameters (leading layers axis; see sarathi_jax.models.llama).
LAYERS_PARAM = "layers"


def stage_of_param(path: tuple[str, ...], layer_ranges: Sequence[tuple[int, int]], embedding_name: str) -> int | None:
    """Which stage owns a parameter: the embedding -> 0, the rest (final norm, LM head) -> the last stage,
    and the stacked layer parameters (`layers/...`) -> None: each stage owns its slice of them."""
    name = path[0]
    if name == embedding_name:
        return 0
    if name == LAYERS_PARAM:
        return None if len(layer_ranges) > 1 else 0
    return len(layer_ranges) - 1


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    source_config: ModelConfig  # the model as stored in the checkpoint
    model_config: ModelConfig  # what the runner builds: num_key_value_heads expanded when KV heads are replicated
    tensor_parallel_size: int
    pipeline_parallel_size: int
    mesh: Mesh  # ("pp", "tp"), shape (pp, tp)
    layer_ranges: tuple[tuple[int, int], ...]
    kv_replication: int  # 1, or how many devices share (a copy of) each KV head
    shard_vocab: bool  # vocab-parallel embedding / LM head (vocab_size % tp == 0)
    embedding_name: str  # top-level parameter name of the input embedding

    def stage_of(self, path: tuple[str, ...]) -> int | None:
        """The stage owning a parameter; None for the stacked layer parameters of a multi-stage pipeline."""
        return stage_of_param(path, self.layer_ranges, self.embedding_name)

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size

    @property
    def is_single_device(self) -> bool:
        return self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1

    @property
    def on_default_device(self) -> bool:
        """The mesh starts at `jax.devices()[0]`, where single-device arrays live. Never with several processes:
        there each process's plain jit runs on its own first device, so every runner keeps its mesh."""
        return jax.process_count() == 1 and self.mesh.devices.flat[0] == jax.devices()[0]

    def stage_mesh(self, stage: int) -> Mesh:
        """Stage `stage`'s devices as a 1-D mesh with axis "tp"."""
        return Mesh(self.mesh.devices[stage], (TP_AXIS,))

    def rules(self, *, for_loading: bool = False) -> tuple[tuple[str, str | None], ...]:
        """Logical-axis rules. `for_loading`: for checkpoint params as stored (replicated k/v projections when
        KV heads are replicated; fusing them at load time expands them)."""
        drop = set()
        if not self.shard_vocab:
            drop.add("vocab")
        if for_loading and self.kv_replication > 1:
            drop.add("kv_heads")
        return tuple((name, None if name in drop else axis) for name, axis in LOGICAL_AXIS_RULES)

    def replicated(self, stage: int) -> NamedSharding:
        return NamedSharding(self.stage_mesh(stage), PartitionSpec())

    def kv_cache_sharding(self, stage: int) -> NamedSharding:
        spec = nn.logical_to_mesh_axes(PartitionSpec(*KV_CACHE_AXES), self.rules())
        return NamedSharding(self.stage_mesh(stage), spec)

    def param_specs(self, *, for_loading: bool = False) -> Any:
        """Tree of mesh `PartitionSpec`s (axis "tp" only), one per parameter leaf: of the model's params, or with
        `for_loading` of the checkpoint's (the checkpoint layout of `source_config`)."""
        if for_loading:
            axes = checkpoint_param_logical_axes(self.source_config)
        else:
            axes = param_logical_axes(self.model_config)
        rules = self.rules(for_loading=for_loading)
        return jax.tree.map(
            lambda spec: nn.logical_to_mesh_axes(spec, rules), axes, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

    def param_shardings(self, *, for_loading: bool = False) -> Any:
        """Tree of shardings for the full parameter tree (with `for_loading`, the checkpoint's: see
        `param_specs`): each leaf on its owning stage's sub-mesh. (A tied
        embedding is owned by stage 0; the runner copies it to the last stage.) The stacked layer parameters
        of a multi-stage pipeline span stages: they are staged on the host CPU device and `place_params`
        sends each stage only its slice (so no accelerator ever holds more than its stage's layers; the
        host holds the layer weights once while loading)."""

        def sharding(path: Any, spec: PartitionSpec) -> jax.sharding.Sharding:
            stage = self.stage_of(tuple(k.key for k in path))
            if stage is None:
                return jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])  # this process's host
            return NamedSharding(self.stage_mesh(stage), spec)

        return jax.tree_util.tree_map_with_path(
            sharding, self.param_specs(for_loading=for_loading), is_leaf=lambda x: isinstance(x, PartitionSpec)
        )


def validate_parallel_config(
    config: ModelConfig, tensor_parallel_size: int, pipeline_parallel_size: int, num_devices: int
) -> int:
    """Raise ValueError when the model cannot be split this way; return the KV-head replication factor."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if tp * pp > num_devices:
        raise ValueError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {tp * pp} devices, "
            f"but only {num_devices} are available ({jax.default_backend()})"
        )
    if config.num_attention_heads % tp:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} is not divisible by tensor_parallel_size={tp}"
        )
    kv = config.num_key_value_heads
    if kv % tp == 0:
        replication = 1
    elif tp % kv == 0:
        replication = tp // kv  # each KV head replicated on tp // kv devices (see the module docstring)
    else:
        raise ValueError(
            f"num_key_value_heads={kv} and tensor_parallel_size={tp}: one must divide the other "
            "(KV heads are split over devices, or replicated when there are fewer KV heads than devices)"
        )
    if config.intermediate_size % tp:
        raise ValueError(f"intermediate_size={config.intermediate_size} is not divisible by tensor_parallel_size={tp}")
    if pp > config.num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} exceeds num_hidden_layers={config.num_hidden_layers} (a stage needs a layer)"
        )
    return replication


def make_mesh(tensor_parallel_size: int, pipeline_parallel_size: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("pp", "tp") mesh over the first tp * pp devices (in `jax.devices()` order: on a multi-host run
    the devices of one process are adjacent, so a stage's TP group stays inside a host when tp divides the
    per-host device count)."""
    devices = list(jax.devices() if devices is None else devices)
    n = tensor_parallel_size * pipeline_parallel_size
    if n > len(devices):
        raise ValueError(
            f"a {pipeline_parallel_size} x {tensor_parallel_size} mesh needs {n} devices, have {len(devices)}"
        )
    grid = np.empty((pipeline_parallel_size, tensor_parallel_size), dtype=object)
    for i, d in enumerate(devices[:n]):
        grid[i // tensor_parallel_size, i % tensor_parallel_size] = d
    return Mesh(grid, (PP_AXIS, TP_AXIS))


def make_plan(
    config: ModelConfig,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    devices: Sequence[Any] | None = None,
) -> ParallelPlan:
    devices = list(jax.devices() if devices is None else devices)
    replication = validate_parallel_config(config, tensor_parallel_size, pipeline_parallel_size, len(devices))
    model_config = config
    if replication > 1:
        model_config = dataclasses.replace(config, num_key_value_heads=config.num_key_value_heads * replication)
    return ParallelPlan(
        source_config=config,
        model_config=model_config,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        mesh=make_mesh(tensor_parallel_size, pipeline_parallel_size, devices),
        layer_ranges=split_layers(config.num_hidden_layers, pipeline_parallel_size),
        kv_replication=replication,
        shard_vocab=config.vocab_size % tensor_parallel_size == 0,
        embedding_name=embedding_param_name(config),
    )
