"""Weight quantization (`sarathi_jax/models/quantization.py`): the int8 and fp8 formulas against torch's and
ml_dtypes' own arithmetic, the parameter trees of a quantized model, the loaders (HF, presets, converted float
folders), and the refusals. The engine's tokens against HF's are in tests/sarathi_jax/engine/test_engine_quantized.py.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from sarathi_jax.models import ModelConfig, get_model, load_model, param_logical_axes, param_shapes, to_out_major
from sarathi_jax.models.attention import init_kv_cache
from sarathi_jax.models.loader import load_model_config
from sarathi_jax.models.quantization import (
    KERNEL_SCALE, check_supported, contracting_axes, dequantize_kernel, fp8_support, quantize_kernel,
)
from tests.sarathi_jax.models.hf_oracle import Chunk, make_step

# Every projection of a Llama layer (fused as the model holds them) and its input axes in the stacked leaf.
LLAMA_PROJECTIONS = {("self_attn", "qkv_proj"): (1,), ("self_attn", "o_proj"): (1, 2),
                     ("mlp", "gate_up_proj"): (1,), ("mlp", "down_proj"): (1,)}


def torch_int8(w_out_in: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The oracle: HF layout `[out, in]`, per output row, in torch (round half to even)."""
    w = torch.from_numpy(w_out_in)
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.numpy(), scale.numpy()


def test_int8_matches_torch_per_output_channel():
    w = np.random.default_rng(0).normal(size=(48, 40)).astype(np.float32)  # [out, in]
    w[3] = 0.0  # a channel of zeros: scale 0, q 0
    w[5, 7] = 2.5 * np.abs(w[5]).max()  # one outlier sets its channel's scale
    q, scale = quantize_kernel(w.T.copy(), (0,), "int8")  # in-major [in, out]: contract axis 0
    q_ref, scale_ref = torch_int8(np.where(np.arange(48)[:, None] == 3, 1.0, w).astype(np.float32))
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (48,)
    keep = np.arange(48) != 3
    np.testing.assert_array_equal(q.T[keep], q_ref[keep])
    np.testing.assert_array_equal(scale[keep], scale_ref[keep])
    assert scale[3] == 0 and not q[:, 3].any()
    assert np.abs(q).max() == 127 and q[7, 5] == 127
    w_hat = dequantize_kernel(q, scale, (0,))
    assert np.all(np.abs(w_hat - w.T) <= scale / 2 + 1e-7)


def test_round_half_to_even():
    w = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]], np.float32).T  # [in 6, out 1], scale 1
    q, scale = quantize_kernel(w, (0,), "int8")
    assert scale.tolist() == [1.0] and q[:, 0].tolist() == [127, 0, 2, 2, 0, -2]


def test_fp8_is_e4m3_of_the_scaled_weight():
    w = np.random.default_rng(1).normal(size=(32, 24)).astype(np.float32)  # [in, out]
    q, scale = quantize_kernel(w, (0,), "fp8")
    assert q.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(scale, np.abs(w).max(axis=0) / np.float32(448))
    np.testing.assert_array_equal(q.astype(np.float32), (w / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert np.abs(q.astype(np.float32)).max() == 448


def assert_quantized_alike(q, scale, q_ref, scale_ref):
    """The devices' q and scales are the host's, bit for bit."""
    np.testing.assert_array_equal(np.asarray(scale), scale_ref)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), np.asarray(q_ref).astype(np.float32))


def test_jax_and_numpy_quantize_alike():
    w = np.random.default_rng(2).normal(size=(3, 16, 2, 8)).astype(np.float32)  # [layers, in, 2, out]
    for method in ("int8", "fp8"):
        q_np, s_np = quantize_kernel(w, (1,), method)
        q_jx, s_jx = jax.jit(lambda x, m=method: quantize_kernel(x, (1,), m))(jnp.asarray(w))
        assert q_jx.dtype == q_np.dtype and s_jx.shape == s_np.shape == (3, 2, 8)
        assert_quantized_alike(q_jx, s_jx, q_np, s_np)


def test_contracting_axes_from_logical_names():
    assert contracting_axes(("layers", "heads", "head_dim", "embed"), ("layers", "embed")) == (1, 2)
    assert contracting_axes(("embed", "kv_heads", "qkv", "head_dim"), ("kv_heads", "qkv", "head_dim")) == (0,)


def test_quantized_tree_has_8bit_kernels_and_scales_with_output_axes():
    config = dataclasses.replace(load_model_config("tiny-llama"), quantization="int8")
    shapes, axes = param_shapes(config), param_logical_axes(config)
    for (block, proj), in_axes in LLAMA_PROJECTIONS.items():
        kernel, scale = shapes["layers"][block][proj]["kernel"], shapes["layers"][block][proj][KERNEL_SCALE]
        assert kernel.dtype == jnp.int8 and scale.dtype == jnp.float32
        kernel_axes, scale_axes = tuple(axes["layers"][block][proj]["kernel"]), tuple(axes["layers"][block][proj][KERNEL_SCALE])
        assert contracting_axes(kernel_axes, scale_axes) == in_axes
        assert scale.shape == tuple(d for i, d in enumerate(kernel.shape) if i not in in_axes)
    # Embedding, norms and the LM head stay in the model dtype.
    assert shapes["embed_tokens"].dtype == jnp.float32
    assert shapes["layers"]["input_layernorm"]["scale"].dtype == jnp.float32


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_preset_weights_are_the_float_draws_quantized(method):
    _, float_params = load_model("tiny-llama", "float32")
    config, params = load_model("tiny-llama", "float32", quantization=method)
    assert config.quantization == method
    for (block, proj), in_axes in LLAMA_PROJECTIONS.items():
        q, scale = quantize_kernel(np.asarray(float_params["layers"][block][proj]["kernel"]), in_axes, method)
        got = params["layers"][block][proj]
        assert_quantized_alike(got["kernel"], got[KERNEL_SCALE], q, scale)
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"]), np.asarray(float_params["embed_tokens"]))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_hf_checkpoint_quantized_at_load_matches_torch(hf_checkpoint, name):
    folder = hf_checkpoint(name)
    config, params = load_model(folder, "float32", quantization="int8")
    from safetensors import safe_open

    tensors = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="numpy") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    w_q = tensors["model.layers.1.self_attn.q_proj.weight"]  # [heads * head_dim, embed]
    q_ref, scale_ref = torch_int8(w_q)
    qkv = params["layers"]["self_attn"]["qkv_proj"]
    per_kv = config.num_attention_heads // config.num_key_value_heads
    # Fused [layers, embed, kv_heads, q_per_kv + 2, head_dim]: the query slots of layer 1, as [heads * head_dim, embed].
    q_fused = np.asarray(qkv["kernel"][1, :, :, :per_kv, :]).reshape(config.hidden_size, -1).T
    s_fused = np.asarray(qkv[KERNEL_SCALE][1, :, :per_kv, :]).reshape(-1)
    np.testing.assert_array_equal(q_fused, q_ref)
    np.testing.assert_array_equal(s_fused, scale_ref)
    if name == "qwen2":  # biases stay float
        assert qkv["bias"].dtype == jnp.float32


def logits(config, params, layout=None):
    model = get_model(config, jnp.float32)
    if layout is not None:
        model, params = to_out_major(model, params, panels=layout == "panels")
    token_ids, positions, metadata, logits_indices = make_step([Chunk([3, 1, 4, 1, 5, 9], 0, [0])], 16, 2, 1, 16)
    kv = init_kv_cache(config, 2, 16, jnp.float32)
    return np.asarray(model.apply({"params": params}, token_ids, positions, kv, metadata, logits_indices)[0][:6])


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_model_computes_with_the_dequantized_weights(method):
    config, params = load_model("tiny-llama", "float32", quantization=method)

    def dequantized(tree):
        if not isinstance(tree, dict):
            return tree
        if KERNEL_SCALE not in tree:
            return {k: dequantized(v) for k, v in tree.items()}
        kernel, scale = tree["kernel"], tree[KERNEL_SCALE]
        in_axes = tuple(range(1, 1 + kernel.ndim - scale.ndim))  # stacked: axis 0 is the layer
        rest = {k: v for k, v in tree.items() if k not in ("kernel", KERNEL_SCALE)}
        return {**rest, "kernel": dequantize_kernel(kernel, scale, in_axes)}

    float_config = dataclasses.replace(config, quantization=None)
    want = logits(float_config, dequantized(params))
    got = logits(config, params)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    got_out_major = logits(config, params, "out_major")
    assert np.max(np.abs(got_out_major - want)) <= 1e-5 * np.max(np.abs(want))


def test_unknown_quantization_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="quantization must be one of int8, fp8"):
        load_model("tiny-llama", "float32", quantization="int4")
    from sarathi_jax import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of int8, fp8"):
        EngineConfig(model="tiny-llama", quantization="awq")


def test_fp8_is_refused_off_fp8_gpus():
    assert "runs on 'cpu'" in fp8_support(jax.devices()[:1])
    with pytest.raises(ValueError, match="quantization='fp8'.*compute capability 8.9"):
        check_supported("fp8", jax.devices()[:1])
    check_supported("int8", jax.devices()[:1])

    class Gpu:
        platform, device_kind = "gpu", "NVIDIA A100-SXM4-80GB"
        compute_capability = "8.0"

    assert "has 8.0" in fp8_support([Gpu()])
    Gpu.compute_capability = "9.0"
    assert fp8_support([Gpu()]) is None


def test_checkpoint_quantized_elsewhere_is_refused_by_name(hf_checkpoint, tmp_path):
    import shutil

    folder = tmp_path / "gptq"
    shutil.copytree(hf_checkpoint("qwen2"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="already quantized \\('gptq'"):
        load_model(folder, "float32")
    with pytest.raises(ValueError, match="'gptq'"):
        ModelConfig.from_pretrained(folder)


def test_float_converted_folder_is_quantized_as_it_is_restored(hf_checkpoint, tmp_path):
    from checkpoints_convert import convert

    folder = hf_checkpoint("llama")
    convert(folder, tmp_path / "orbax", "float32", log=lambda message: None)
    config, restored = load_model(tmp_path / "orbax", "float32", quantization="int8")
    _, read = load_model(folder, "float32", quantization="int8")
    assert config.quantization == "int8"
    for (block, proj), _ in LLAMA_PROJECTIONS.items():
        got, want = restored["layers"][block][proj], read["layers"][block][proj]
        assert got["kernel"].dtype == jnp.int8
        assert_quantized_alike(got["kernel"], got[KERNEL_SCALE], want["kernel"], want[KERNEL_SCALE])
    # Asked for nothing, the float folder serves float weights.
    assert load_model_config(tmp_path / "orbax").quantization is None
