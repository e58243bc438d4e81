"""Model families: the one place that maps an architecture (HF `architectures[0]`) to its implementation.

    family = model_family(config)                        # ValueError for an unsupported architecture
    model = family.get_model(config, dtype, attention_fn)
    family.param_shapes(config, dtype), family.param_logical_axes(config), family.param_plan(config)
    model, params = to_out_major(model, params)          # projection weights [out, in] (`out_major.py`),
    model, params = to_out_major(model, params, panels=True)  # or packed into column panels

`param_shapes` and `param_logical_axes` describe the model's own (serving) parameters; `checkpoint_param_shapes`
and `checkpoint_param_logical_axes` the checkpoint layout, with separate q/k/v and gate/up (`fusion.py`), which
`param_plan`, converted checkpoints and random draws use.

`llama.py` serves the Llama family (Llama, Mistral, Qwen2, Qwen3), `falcon.py` serves `FalconForCausalLM`. A
family is its Flax module class and its Hugging Face parameter mapping (`hf_param_plan`, written beside the
model); everything else here is generic over the module. The module-level functions are the package's API.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallas_kernels import ragged_paged_attention_xla
from pallas_kernels.panel_matmul_cpu import pack_panels
from sarathi_jax.models import falcon, llama
from sarathi_jax.models.attention import AttentionMetadata, init_kv_cache
from sarathi_jax.models.config import FALCON_ARCHITECTURES, LLAMA_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig
from sarathi_jax.models.fusion import checkpoint_logical_axes, checkpoint_shapes
from sarathi_jax.models.layers import AttentionFn
from sarathi_jax.models.out_major import OUT_MAJOR, PANELS
from sarathi_jax.models.param_source import ParamSource


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One implementation of the model contract (docs/design/models.md) and the architectures it serves."""

    name: str
    architectures: tuple[str, ...]
    # Flax module with fields `config`, `dtype`, `attention_fn`, `layer_range`, `scan_layers`.
    model_class: type[nn.Module]
    # Every parameter of the checkpoint layout and where it comes from in an HF checkpoint, in load order.
    hf_param_plan: Callable[[ModelConfig], Iterable[ParamSource]]

    def get_model(self, config: ModelConfig, dtype: Any = jnp.float32, attention_fn: AttentionFn | None = None) -> nn.Module:
        """The Flax module for `config`; `attention_fn` picks the attention backend (default: the jnp one)."""
        return self.model_class(
            config=config, dtype=jnp.dtype(dtype), attention_fn=attention_fn or ragged_paged_attention_xla
        )

    def param_shapes(self, config: ModelConfig, dtype: Any = jnp.float32) -> Any:
        """Tree of `jax.ShapeDtypeStruct` of the (unboxed) params."""
        return nn.meta.unbox(self._boxed_param_shapes(config, jnp.dtype(dtype)))

    def param_logical_axes(self, config: ModelConfig) -> Any:
        """Tree (same structure as the params) of `PartitionSpec`s of logical axis names, e.g.
        `PartitionSpec("layers", "embed", "kv_heads", "qkv", "head_dim")` for layers/self_attn/qkv_proj/kernel."""
        return nn.get_partition_spec(self._boxed_param_shapes(config, jnp.float32))

    def param_plan(self, config: ModelConfig) -> list[ParamSource]:
        return list(self.hf_param_plan(config))

    def _boxed_param_shapes(self, config: ModelConfig, dtype: Any) -> Any:
        model = self.get_model(config, dtype)
        return jax.eval_shape(lambda: model.init(jax.random.key(0), *dummy_inputs(config, dtype)))["params"]


LLAMA = ModelFamily("llama", LLAMA_ARCHITECTURES, llama.LlamaForCausalLM, llama.hf_param_plan)
FALCON = ModelFamily("falcon", FALCON_ARCHITECTURES, falcon.FalconForCausalLM, falcon.hf_param_plan)

# Architecture name -> its family; and -> its Flax module class.
MODEL_FAMILIES: dict[str, ModelFamily] = {arch: family for family in (LLAMA, FALCON) for arch in family.architectures}
MODEL_REGISTRY: dict[str, type[nn.Module]] = {arch: family.model_class for arch, family in MODEL_FAMILIES.items()}


def model_family(config: ModelConfig) -> ModelFamily:
    """The family implementing `config.architecture`."""
    if config.architecture not in MODEL_FAMILIES:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return MODEL_FAMILIES[config.architecture]


def get_model(config: ModelConfig, dtype: Any = jnp.float32, attention_fn: AttentionFn | None = None) -> nn.Module:
    """The Flax module for `config`; `attention_fn` picks the attention backend (default: the jnp one)."""
    return model_family(config).get_model(config, dtype, attention_fn=attention_fn)


def param_shapes(config: ModelConfig, dtype: Any = jnp.float32) -> Any:
    """Tree of `jax.ShapeDtypeStruct` of the (unboxed) params."""
    return model_family(config).param_shapes(config, dtype)


def param_logical_axes(config: ModelConfig) -> Any:
    """Tree (same structure as the params) of `PartitionSpec`s of logical axis names; map it onto a mesh with
    `nn.logical_to_mesh_sharding(param_logical_axes(config), mesh, rules)`."""
    return model_family(config).param_logical_axes(config)


def checkpoint_param_shapes(config: ModelConfig, dtype: Any = jnp.float32) -> Any:
    """`param_shapes` in the checkpoint layout (separate q/k/v and gate/up, see `fusion.py`)."""
    return checkpoint_shapes(param_shapes(config, dtype))


def checkpoint_param_logical_axes(config: ModelConfig) -> Any:
    """`param_logical_axes` in the checkpoint layout (separate q/k/v and gate/up, see `fusion.py`)."""
    return checkpoint_logical_axes(param_logical_axes(config))


def param_plan(config: ModelConfig) -> list[ParamSource]:
    """Every parameter of `config`'s checkpoint layout and where it comes from in the HF checkpoint, in load order."""
    return model_family(config).param_plan(config)


def dummy_inputs(config: ModelConfig, dtype: Any = jnp.float32) -> tuple[Any, ...]:
    """Smallest valid `(token_ids, positions, kv_cache, metadata, logits_indices)`, for `init`/`eval_shape`."""
    metadata = AttentionMetadata(
        slot_mapping=jnp.zeros((1,), jnp.int32),
        kv_lens=jnp.ones((1,), jnp.int32),
        block_tables=jnp.zeros((1, 1), jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        num_seqs=jnp.ones((1,), jnp.int32),
    )
    kv_cache = init_kv_cache(config, num_blocks=1, block_size=1, dtype=dtype)
    token_ids = jnp.zeros((1,), jnp.int32)
    return token_ids, jnp.zeros((1,), jnp.int32), kv_cache, metadata, jnp.zeros((1,), jnp.int32)


def to_out_major(model: nn.Module, params: Any, *, panels: bool = False) -> tuple[nn.Module, Any]:
    """`model` (a `PagedDecoderLM`) with out-major projections (`out_major.py`: what a single-device CPU runner
    uses), and `params` (of `model`, in-major) moved to that layout: every parameter whose logical axes differ
    between the two is transposed to the new order (the projection kernels; stacked layers keep their leading
    axis first). With `panels` (float32 weights), the projection kernels are then packed into column panels
    (the `PANELS` layout). Scanned or unrolled, as `model` is."""
    out_model = model.clone(projection_layout=OUT_MAJOR)
    inputs = dummy_inputs(model.config, model.dtype)

    def abstract(m: nn.Module) -> Any:
        return jax.eval_shape(lambda: m.init(jax.random.key(0), *inputs))["params"]

    def move(x: jax.Array, src: PartitionSpec, dst: PartitionSpec) -> jax.Array:
        if tuple(src) == tuple(dst):
            return x
        return jnp.transpose(x, [tuple(src).index(name) for name in dst])

    axes = nn.get_partition_spec
    moved = jax.tree.map(move, params, axes(abstract(model)), axes(abstract(out_model)))
    if not panels:
        return out_model, moved
    panel_model = model.clone(projection_layout=PANELS)
    packed = abstract(panel_model)

    def pack(x: jax.Array, src: PartitionSpec, dst: PartitionSpec, want: jax.ShapeDtypeStruct) -> jax.Array:
        if tuple(src) == tuple(dst):  # not a projection kernel (the panels' axes are unnamed)
            return x
        *lead, _, k, _ = want.shape  # [..., out..., in...] -> [..., out, in] -> [..., panels, in, 64]
        return pack_panels(x.reshape(*lead, -1, k))

    return panel_model, jax.tree.map(pack, moved, axes(abstract(out_model)), axes(packed), nn.meta.unbox(packed))
