"""Load checkpoints into the model parameter trees (`LlamaForCausalLM`, `FalconForCausalLM`).

`load_model(name_or_path)` takes a preset name (seeded random weights), a Hugging Face folder or a converted
one, and returns `(config, params)`. Checkpoints hold the checkpoint layout (separate q/k/v and gate/up
projections, as HF stores them); `load_model` fuses them once into the model's own layout
(`fusion.fuse_projections`). `load_hf_params` and `load_orbax_params` return the checkpoint layout.

Hugging Face safetensors: tensors are streamed one at a time (`safetensors.safe_open`, memory-mapped),
converted to the target dtype and moved to the device, so peak host memory is about one tensor.
`param_plan(config)` (`families.py`) is the whole name and layout mapping as data (`ParamSource` per
parameter), written beside each model (`llama.hf_param_plan`, `falcon.hf_param_plan`);
`hf_to_params_items` applies it to any `get_tensor(name) -> np.ndarray`; converters reuse both.

Orbax: folders written by `python -m checkpoints_convert` (the parameter tree as an Orbax PyTree checkpoint
under `params/`, the HF config and tokenizer files beside it, and the completion marker
`sarathi_checkpoint.json`, written last). `load_orbax_params` restores them straight into the requested
shardings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from sarathi_jax.models.config import ModelConfig, check_quantization
from sarathi_jax.models.families import checkpoint_param_logical_axes, checkpoint_param_shapes, param_plan
from sarathi_jax.models.fusion import fuse_projections
from sarathi_jax.models.param_source import ParamPath, ParamSource
from sarathi_jax.models.presets import PRESETS
from sarathi_jax.models.quantization import KERNEL_SCALE, contracting_axes, quantize_kernel, quantize_tree
from sarathi_jax.models.random_init import init_random_params

# Returns the named tensor, raises KeyError if the checkpoint has no such tensor.
GetTensor = Callable[[str], np.ndarray]

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

# Layout of a converted (Orbax) checkpoint folder.
ORBAX_PARAMS_DIR = "params"
CHECKPOINT_MARKER = "sarathi_checkpoint.json"  # written last: its presence means the folder is complete
CHECKPOINT_FORMAT = "sarathi-jax-orbax"
# v3: an untied LM head is stored [vocab, embed] (HF's layout; v2 stored it [embed, vocab]). v2: decoder layers
# stacked on a leading axis (`layers/...`, the scanned model); v1 had `layers_{i}/...`.
CHECKPOINT_FORMAT_VERSION = 3


class CheckpointError(ValueError):
    """A checkpoint misses a tensor, has a mis-shaped one, is incomplete or corrupt, or cannot be found."""


def hf_to_params_items(
    config: ModelConfig, get_tensor: GetTensor
) -> Iterator[tuple[ParamSource, np.ndarray]]:
    """Yield `(source, array)` for every parameter (one layer's slice of a stacked one), in the checkpoint
    layout of `llama.py` / `falcon.py`, from HF tensors.

    Linear weights are `[out, in]` in HF and `[in..., out...]` here, with the heads axis split out (and
    Falcon's fused query_key_value split into q/k/v). Each HF tensor's shape is checked before it is reshaped.
    Extra checkpoint tensors are ignored (e.g. `lm_head.weight` of a tied model, old `rotary_emb.inv_freq`
    buffers).
    """
    last: tuple[str, np.ndarray] | None = None  # a fused tensor feeds several params in a row: fetch it once
    for source in param_plan(config):
        if last is None or last[0] != source.name:
            last = None  # drop the previous tensor before fetching the next
            last = (source.name, _fetch(get_tensor, source.name, source.hf_shape))
        yield source, source.apply(last[1])


def _fetch(get_tensor: GetTensor, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
    try:
        tensor = get_tensor(name)
    except KeyError:
        raise CheckpointError(f"checkpoint is missing tensor {name!r}") from None
    if tuple(tensor.shape) != expected_shape:
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected_shape} for this config"
        )
    return tensor


@contextlib.contextmanager
def open_safetensors(path: str | os.PathLike[str]) -> Iterator[GetTensor]:
    """`get_tensor` over the checkpoint folder: `model.safetensors`, or shards listed in the index file."""
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    single_path = os.path.join(path, SAFETENSORS_SINGLE)
    with contextlib.ExitStack() as stack:
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.exists(single_path):
            weight_map = {}
        else:
            raise CheckpointError(f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {os.fspath(path)!r}")
        handles: dict[str, Any] = {}

        def handle(file_name: str) -> Any:
            if file_name not in handles:
                file_path = os.path.join(path, file_name)
                if not os.path.exists(file_path):
                    raise CheckpointError(f"shard {file_name!r} listed in the index is missing from {os.fspath(path)!r}")
                handles[file_name] = stack.enter_context(safe_open(file_path, framework="numpy"))
            return handles[file_name]

        def get_tensor(name: str) -> np.ndarray:
            if weight_map:
                if name not in weight_map:
                    raise KeyError(name)
                f = handle(weight_map[name])
            else:
                f = handle(SAFETENSORS_SINGLE)
            if name not in f.keys():
                raise KeyError(name)
            return f.get_tensor(name)

        yield get_tensor


def load_hf_params(
    config: ModelConfig, path: str | os.PathLike[str], dtype: Any = jnp.float32, shardings: Any = None
) -> Any:
    """Load the params of `config` from the safetensors checkpoint in folder `path`, as `dtype` arrays, in the
    checkpoint layout (`checkpoint_param_shapes`). With `config.quantization` each projection kernel is
    quantized on the host as it is read (`quantization.quantize_kernel`, from its float32 values), so host
    memory stays about one tensor and only the 8-bit weights and their scales reach the devices.

    `shardings`: optional tree (same structure as the params) of `jax.sharding.Sharding`, one per leaf;
    default: the default device.
    """
    dtype = jnp.dtype(dtype)
    expected = checkpoint_param_shapes(config, dtype)
    leaf_of = {tuple(k.key for k in p): x for p, x in jax.tree_util.tree_leaves_with_path(expected)}
    in_axes_of = quantized_in_axes(config)
    sharding_of = _sharding_lookup(shardings)
    params: dict[str, Any] = {}
    with open_safetensors(path) as get_tensor:
        for source, array in hf_to_params_items(config, get_tensor):
            path_ = source.param_path
            node = params
            for key in path_[:-1]:
                node = node.setdefault(key, {})
            in_axes = in_axes_of(source)
            if in_axes is not None:
                scale_path = path_[:-1] + (KERNEL_SCALE,)
                q, scale = quantize_kernel(np.asarray(array, np.float32), in_axes, config.quantization)
                _place(node, KERNEL_SCALE, scale, source.layer, leaf_of[scale_path], sharding_of(scale_path))
                value = q
            else:
                # Cast on the host (ml_dtypes handles bfloat16) so only `dtype` bytes reach the device.
                value = np.asarray(array, dtype=leaf_of[path_].dtype)
            _place(node, path_[-1], value, source.layer, leaf_of[path_], sharding_of(path_))
    # Guards the mapping itself: the loaded tree must be exactly the model's.
    got = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
    want = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(expected)}
    _check_tree(got, want, "loaded params")
    return params


def _place(node: dict[str, Any], name: str, value: np.ndarray, layer: int | None, leaf: jax.ShapeDtypeStruct,
           sharding: Any) -> None:
    """`node[name] = value` on the devices: a whole parameter (`layer` None), or layer `layer` of a stacked one,
    written into one device buffer in place (created on first use), so the host holds one layer's tensor at a
    time and no stacked copy is ever made."""
    if layer is None:
        node[name] = jax.device_put(value, sharding)
        return
    if name not in node:
        node[name] = _zeros(tuple(leaf.shape), leaf.dtype, sharding)
    node[name] = _set_layer(node[name], jax.device_put(value, _layer_sharding(node[name])), layer)


def _logical_axes_of(config: ModelConfig) -> dict[ParamPath, tuple[str | None, ...]]:
    """`param_path -> logical axis names` of `config`'s checkpoint layout."""
    specs = checkpoint_param_logical_axes(config)
    return {tuple(str(getattr(k, "key", k)) for k in path): tuple(spec)
            for path, spec in jax.tree_util.tree_leaves_with_path(
                specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))}


def quantized_in_axes(config: ModelConfig) -> Callable[[ParamSource], tuple[int, ...] | None]:
    """`source -> in_axes`: for a planned parameter that `config` stores quantized (a projection `kernel` with a
    `kernel_scale` beside it), the input (contracting) axes of the array `source` yields, i.e. of one layer's
    slice for a stacked parameter (the leading layers axis stripped), to give `quantize_kernel`; None for every
    other parameter, and for all of them when `config.quantization` is None. Shared by `load_hf_params` and
    `checkpoints_convert --quantization`, so both quantize the same float values the same way."""
    if config.quantization is None:
        return lambda source: None
    axes_of = _logical_axes_of(config)

    def in_axes(source: ParamSource) -> tuple[int, ...] | None:
        path = tuple(source.param_path)
        scale_path = path[:-1] + (KERNEL_SCALE,)
        if path[-1] != "kernel" or scale_path not in axes_of:
            return None
        kernel_axes, scale_axes = axes_of[path], axes_of[scale_path]
        if source.layer is not None:  # one layer's slice: the stacked leaf without its leading axis
            kernel_axes, scale_axes = kernel_axes[1:], scale_axes[1:]
        return contracting_axes(kernel_axes, scale_axes)

    return in_axes


@functools.cache
def _zeros_fn(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _zeros(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.Array:
    """A zero array created on the device(s) of `sharding` (default device when None)."""
    return _zeros_fn(shape, jnp.dtype(dtype), sharding)()


def _layer_sharding(stacked: jax.Array) -> Any:
    """The sharding of one layer's slice of `stacked`: its spec without the leading layers axis."""
    sharding = stacked.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return sharding


# In place (the stacked buffer is donated): `stacked[layer] = value`. One compile per leaf shape.
_set_layer = jax.jit(
    lambda stacked, value, layer: jax.lax.dynamic_update_index_in_dim(stacked, value, layer, 0),
    donate_argnums=(0,),
)


def _check_tree(got: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]], what: str) -> None:
    if got != want:
        raise CheckpointError(
            f"{what} do not match the model: missing {sorted(want.keys() - got.keys())}, "
            f"unexpected {sorted(got.keys() - want.keys())}, "
            f"mis-shaped {sorted(k for k in got.keys() & want.keys() if got[k] != want[k])}"
        )


def _sharding_lookup(shardings: Any) -> Callable[[ParamPath], Any]:
    """`param_path -> Sharding or None` over an optional shardings tree."""
    if shardings is None:
        return lambda path: None
    flat = {
        tuple(str(getattr(k, "key", k)) for k in path): s
        for path, s in jax.tree_util.tree_leaves_with_path(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    }
    return lambda path: flat[tuple(path)]


def param_path_str(path: ParamPath) -> str:
    """`("layers", "mlp", "up_proj", "kernel")` -> `"layers/mlp/up_proj/kernel"` (marker-file keys)."""
    return "/".join(path)


# ---------------------------------------------------------------------------------------------- Orbax


def is_orbax_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether folder `path` is (or is the unfinished start of) a converted Orbax checkpoint."""
    return any(
        os.path.exists(os.path.join(path, name))
        for name in (CHECKPOINT_MARKER, ORBAX_PARAMS_DIR, ORBAX_PARAMS_DIR + ".partial_save")
    )


def read_checkpoint_marker(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The completion marker of a converted checkpoint; CheckpointError if the conversion never finished."""
    marker_path = os.path.join(path, CHECKPOINT_MARKER)
    if not os.path.exists(marker_path):
        raise CheckpointError(
            f"{os.fspath(path)!r} is an incomplete converted checkpoint (no {CHECKPOINT_MARKER}: the conversion "
            "was interrupted); convert again with `python -m checkpoints_convert --force`"
        )
    with open(marker_path) as f:
        marker = json.load(f)
    if marker.get("format") == CHECKPOINT_FORMAT and marker.get("format_version") == 1:
        raise CheckpointError(
            f"{os.fspath(path)!r} was converted by an older sarathi-jax (checkpoint format v1: one parameter "
            f"tree per layer); this version stacks the layers (format v{CHECKPOINT_FORMAT_VERSION}). Convert it "
            "again from the Hugging Face folder: `python -m checkpoints_convert --hf HF_DIR --out DIR --force`"
        )
    if marker.get("format") == CHECKPOINT_FORMAT and marker.get("format_version") == 2:
        if "lm_head" not in marker.get("params", {}):
            return marker  # a tied head: v2 and v3 hold the same arrays
        raise CheckpointError(
            f"{os.fspath(path)!r} was converted by an older sarathi-jax (checkpoint format v2: the LM head stored "
            f"[embed, vocab]); this version stores it [vocab, embed] (format v{CHECKPOINT_FORMAT_VERSION}). Convert "
            "it again: `python -m checkpoints_convert --hf HF_DIR --out DIR --force` (or `--gguf FILE`)"
        )
    if marker.get("format") != CHECKPOINT_FORMAT or marker.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(
            f"{marker_path!r} is not a {CHECKPOINT_FORMAT} v{CHECKPOINT_FORMAT_VERSION} marker "
            f"(format={marker.get('format')!r}, format_version={marker.get('format_version')!r})"
        )
    return marker


def load_orbax_params(
    config: ModelConfig, path: str | os.PathLike[str], dtype: Any = jnp.float32, shardings: Any = None
) -> Any:
    """Restore the params of a converted checkpoint folder straight into `shardings`, in the checkpoint layout
    (`checkpoint_param_shapes`: converted folders hold separate q/k/v and gate/up projections).

    `shardings`: optional tree (same structure as the params) of `jax.sharding.Sharding`, one per leaf;
    default: every leaf on the default device. Each leaf is restored by Orbax with
    `ArrayRestoreArgs(sharding=..., dtype=dtype)`, so each device reads only its own shard from disk and no
    full host copy per device is made. Values are cast to `dtype` if the checkpoint holds another. A folder of
    int8 weights restores them as they are; a float folder asked for `config.quantization` restores each
    projection kernel on its own and quantizes it (`quantization.quantize_tree`) before reading the next.
    """
    import orbax.checkpoint as ocp  # heavy import; only converted checkpoints need it

    dtype = jnp.dtype(dtype)
    marker = read_checkpoint_marker(path)
    if marker.get("architecture") != config.architecture:
        raise CheckpointError(
            f"{os.fspath(path)!r}: marker says architecture {marker.get('architecture')!r}, "
            f"config.json says {config.architecture!r}"
        )
    checkpoint_quantization(path, config.quantization, marker)
    stored = marker.get("quantization")
    source = dataclasses.replace(config, quantization=stored)  # what the folder holds
    expected = checkpoint_param_shapes(source, dtype)
    want = {param_path_str(tuple(k.key for k in p)): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(expected)}
    got = {name: tuple(info["shape"]) for name, info in marker.get("params", {}).items()}
    _check_tree(got, want, f"params of {os.fspath(path)!r}")

    sharding_of = _sharding_lookup(shardings)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def restore_args(key_path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> Any:
        param_path = tuple(k.key for k in key_path)
        return ocp.ArrayRestoreArgs(
            sharding=sharding_of(param_path) or default, global_shape=tuple(leaf.shape), dtype=leaf.dtype
        )

    pytree_dir = os.path.join(os.path.abspath(path), marker["pytree_dir"])
    args = jax.tree_util.tree_map_with_path(restore_args, expected)
    # Float weights served quantized: each kernel to quantize is restored on its own and quantized before the
    # next (device memory: the 8-bit weights plus one float kernel); everything else in one restore.
    target_axes = checkpoint_param_logical_axes(config) if config.quantization is not None and stored is None else None
    kernels = _kernels_to_quantize(expected, target_axes)
    params: dict[str, Any] = {}
    with ocp.PyTreeCheckpointer() as checkpointer:
        def restore(paths: list[ParamPath]) -> dict[str, Any]:
            try:
                return checkpointer.restore(pytree_dir, args=ocp.args.PyTreeRestore(
                    item=_subtree(expected, paths), restore_args=_subtree(args, paths), partial_restore=True))
            except (FileNotFoundError, ValueError, KeyError) as e:
                raise CheckpointError(f"cannot restore the Orbax params in {pytree_dir!r}: {e}") from e

        rest = [p for p in _leaf_paths(expected) if p not in kernels]
        _merge(params, restore(rest))
        for kernel in kernels:
            _merge(params, quantize_tree(restore([kernel]), target_axes, config.quantization))
    served = expected if target_axes is None else checkpoint_param_shapes(config, dtype)
    got = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(served)}
    _check_tree(got, want, f"restored params of {os.fspath(path)!r}")
    return params


def _leaf_paths(tree: Any) -> list[ParamPath]:
    return [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _kernels_to_quantize(expected: Any, target_axes: Any) -> list[ParamPath]:
    """The paths of `expected`'s kernels that have a `kernel_scale` in `target_axes` (none when it is None)."""
    if target_axes is None:
        return []
    scales = {path[:-1] for path in _leaf_paths(target_axes) if path[-1] == KERNEL_SCALE}
    return [path for path in _leaf_paths(expected) if path[-1] == "kernel" and path[:-1] in scales]


def _subtree(tree: dict[str, Any], paths: list[ParamPath]) -> dict[str, Any]:
    """The nested dicts of `tree` holding only the leaves at `paths`."""
    out: dict[str, Any] = {}
    for path in paths:
        node, src = out, tree
        for key in path[:-1]:
            node, src = node.setdefault(key, {}), src[key]
        node[path[-1]] = src[path[-1]]
    return out


def _merge(into: dict[str, Any], tree: dict[str, Any]) -> None:
    for key, value in tree.items():
        if isinstance(value, dict):
            _merge(into.setdefault(key, {}), value)
        else:
            into[key] = value


def checkpoint_quantization(path: str | os.PathLike[str], requested: str | None,
                            marker: dict[str, Any] | None = None) -> str | None:
    """The quantization a converted folder serves with `requested`: a folder of quantized weights (its marker
    says which) its own, also when None is requested; a float folder `requested`. CheckpointError for a folder
    quantized otherwise than requested."""
    stored = (marker or read_checkpoint_marker(path)).get("quantization")
    if stored is None:
        return requested
    if requested not in (None, stored):
        raise CheckpointError(
            f"{os.fspath(path)!r} holds {stored} weights (converted with --quantization {stored}); it cannot serve "
            f"quantization={requested!r}: serve it as {stored}, or convert the float checkpoint again"
        )
    return stored


# ---------------------------------------------------------------------------------------------- any model


def check_not_ambiguous(name: str) -> None:
    """A bare preset name that is also a folder here could mean either: refuse it rather than guess."""
    if name in PRESETS and os.path.isdir(name):
        raise ValueError(
            f"{name!r} is both a model preset and a folder in {os.getcwd()!r}; pass the folder as "
            f"{os.path.join('.', name)!r} (or rename it) to load it, or run from elsewhere for the preset"
        )


def load_model(
    name_or_path: str | os.PathLike[str], dtype: Any = jnp.float32, seed: int = 0, shardings: Any = None,
    kv_replication: int = 1, quantization: str | None = None,
) -> tuple[ModelConfig, Any]:
    """`(config, params)` for a preset name (seeded random weights), a Hugging Face checkpoint folder, or a
    folder converted by `python -m checkpoints_convert` (Orbax params, restored directly). The params are in
    the model's layout: read in the checkpoint layout, then fused (`fusion.fuse_projections`), with the q/k/v
    projection built for KV heads repeated `kv_replication` times (tensor parallelism, see `parallel.plan`).

    `shardings`: optional tree of one `jax.sharding.Sharding` per leaf of the checkpoint layout (e.g. from
    `nn.logical_to_mesh_sharding(checkpoint_param_logical_axes(config), mesh, rules)`); default: the default
    device. Converted checkpoints are restored into it shard by shard; each fused leaf takes the sharding of its
    first part (q, gate) with an unsharded fused axis.

    `quantization` ("int8", "fp8"; `quantization.py`): the decoder layers' projections are quantized as they are
    read, or come quantized from a folder converted with `--quantization`; a converted folder's quantization is
    served when None is asked (`load_model_config`). The returned config says which (`config.quantization`).
    """
    config = load_model_config(name_or_path, quantization)
    name = os.fspath(name_or_path)
    if name in PRESETS:  # each device draws its own shards
        return config, init_random_params(config, dtype, seed, shardings, kv_replication)
    if is_orbax_checkpoint(name):
        return config, fuse_projections(load_orbax_params(config, name, dtype, shardings), kv_replication)
    return config, fuse_projections(load_hf_params(config, name, dtype, shardings=shardings), kv_replication)


def load_model_config(name_or_path: str | os.PathLike[str], quantization: str | None = None) -> ModelConfig:
    """The `ModelConfig` of a preset, HF folder or converted (Orbax) folder, without reading weights, with the
    quantization its weights will be served in: `quantization`, or a converted folder's own
    (`checkpoint_quantization`). ValueError (CheckpointError) for a name that is neither, an interrupted
    conversion, an unknown quantization or one the folder cannot serve."""
    name = os.fspath(name_or_path)
    check_not_ambiguous(name)
    check_quantization(quantization)
    if name in PRESETS:
        return dataclasses.replace(PRESETS[name], quantization=quantization)
    if not os.path.isdir(name):
        raise ValueError(f"{name!r} is neither a model preset ({', '.join(sorted(PRESETS))}) nor a checkpoint folder")
    if is_orbax_checkpoint(name):
        # An interrupted conversion fails here, before anything is parsed.
        # A quantized folder serves its own quantization; a float folder the one asked for.
        quantization = checkpoint_quantization(name, quantization, read_checkpoint_marker(name))
    return dataclasses.replace(ModelConfig.from_pretrained(name), quantization=quantization)
