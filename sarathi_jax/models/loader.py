"""Load Hugging Face safetensors checkpoints into the `LlamaForCausalLM` parameter tree.

Tensors are streamed one at a time (`safetensors.safe_open`, memory-mapped), converted to the target dtype
and moved to the device, so peak host memory is about one tensor. `hf_to_params_items` holds the whole name
and layout mapping and is reusable by converters: give it any `get_tensor(name) -> np.ndarray`.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from sarathi_jax.models.config import ModelConfig
from sarathi_jax.models.llama import param_shapes

ParamPath = tuple[str, ...]
# Returns the named tensor, raises KeyError if the checkpoint has no such tensor.
GetTensor = Callable[[str], np.ndarray]

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint misses a tensor, has a mis-shaped one, or cannot be found."""


def hf_to_params_items(config: ModelConfig, get_tensor: GetTensor) -> Iterator[tuple[ParamPath, np.ndarray]]:
    """Yield `(param_path, array)` for every parameter, in the layout of `llama.py`, from HF tensors.

    Linear weights are `[out, in]` in HF and `[in..., out...]` here, with the heads axis split out.
    Each HF tensor's shape is checked before it is reshaped. Extra checkpoint tensors are ignored
    (e.g. `lm_head.weight` of a tied model, old `rotary_emb.inv_freq` buffers).
    """
    c = config
    embed, vocab, mlp = c.hidden_size, c.vocab_size, c.intermediate_size
    heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def fetch(name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        try:
            tensor = get_tensor(name)
        except KeyError:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}") from None
        if tuple(tensor.shape) != expected_shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected_shape} for this config"
            )
        return tensor

    yield ("embed_tokens",), fetch("model.embed_tokens.weight", (vocab, embed))
    for i in range(c.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers_{i}"
        attn = hf + "self_attn."
        yield (ours, "input_layernorm", "scale"), fetch(hf + "input_layernorm.weight", (embed,))
        for proj, num_heads in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            weight = fetch(f"{attn}{proj}.weight", (num_heads * head_dim, embed))
            yield (ours, "self_attn", proj, "kernel"), weight.T.reshape(embed, num_heads, head_dim)
            if c.attention_bias:
                bias = fetch(f"{attn}{proj}.bias", (num_heads * head_dim,))
                yield (ours, "self_attn", proj, "bias"), bias.reshape(num_heads, head_dim)
        o_weight = fetch(attn + "o_proj.weight", (embed, heads * head_dim))
        yield (ours, "self_attn", "o_proj", "kernel"), o_weight.T.reshape(heads, head_dim, embed)
        if c.attention_out_bias:
            yield (ours, "self_attn", "o_proj", "bias"), fetch(attn + "o_proj.bias", (embed,))
        if c.qk_norm:
            yield (ours, "self_attn", "q_norm", "scale"), fetch(attn + "q_norm.weight", (head_dim,))
            yield (ours, "self_attn", "k_norm", "scale"), fetch(attn + "k_norm.weight", (head_dim,))
        yield (ours, "post_attention_layernorm", "scale"), fetch(hf + "post_attention_layernorm.weight", (embed,))
        yield (ours, "mlp", "gate_proj", "kernel"), fetch(hf + "mlp.gate_proj.weight", (mlp, embed)).T
        yield (ours, "mlp", "up_proj", "kernel"), fetch(hf + "mlp.up_proj.weight", (mlp, embed)).T
        yield (ours, "mlp", "down_proj", "kernel"), fetch(hf + "mlp.down_proj.weight", (embed, mlp)).T
    yield ("norm", "scale"), fetch("model.norm.weight", (embed,))
    if not c.tie_word_embeddings:
        yield ("lm_head",), fetch("lm_head.weight", (vocab, embed)).T


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


def load_hf_params(config: ModelConfig, path: str | os.PathLike[str], dtype: Any = jnp.float32) -> Any:
    """Load the params of `config` from the safetensors checkpoint in folder `path`, as `dtype` arrays."""
    dtype = jnp.dtype(dtype)
    expected = param_shapes(config, dtype)
    params: dict[str, Any] = {}
    with open_safetensors(path) as get_tensor:
        for param_path, array in hf_to_params_items(config, get_tensor):
            node = params
            for key in param_path[:-1]:
                node = node.setdefault(key, {})
            # Cast on the host (ml_dtypes handles bfloat16) so only `dtype` bytes reach the device.
            node[param_path[-1]] = jax.device_put(np.asarray(array, dtype=dtype))
    # Guards the mapping itself: the loaded tree must be exactly the model's.
    got = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
    want = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(expected)}
    if got != want:
        raise CheckpointError(
            f"loaded params do not match the model: missing {sorted(want.keys() - got.keys())}, "
            f"unexpected {sorted(got.keys() - want.keys())}, "
            f"mis-shaped {sorted(k for k in got.keys() & want.keys() if got[k] != want[k])}"
        )
    return params
