"""Small GGUF files written with the `gguf` package's writer from the tiny HF test checkpoints: every quant type
the converter reads (plain and K-quants, in row chunks), llama.cpp's Q/K row permutation, untied LM heads,
Llama 3 RoPE scaling stored as `rope_freqs.weight`, and refused architectures. The converted models' logits
must equal HF's on the same dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoints_convert.__main__ import main
from checkpoints_convert.gguf_source import GGUFCheckpoint, _reverse_permute
from sarathi_jax.models import ModelConfig


def test_reverse_permute_inverts_llama_cpp_permute() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(_reverse_permute(_llama_cpp_permute(w, 3), 3), w)


def test_other_architecture_is_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny-qwen.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'qwen2' is not supported"):
        GGUFCheckpoint(path)
    assert main(["--gguf", str(path), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (HF q/k rows -> GGUF rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """llama.cpp's `rope_freqs.weight` for Llama 3 scaling (convert_hf_to_gguf.py's formula, float32)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    old, low, high, factor = (scaling["original_max_position_embeddings"], scaling["low_freq_factor"],
                              scaling["high_freq_factor"], scaling["factor"])
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


# Quantization types of the synthetic GGUF, cycled over its 2-D tensors (the gguf package quantizes these in
# numpy; SmolLM2's file covers Q4_1 / Q8_0 on a real model).
SYNTHETIC_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "BF16", "Q5_0", "F32", "Q5_1")
# The gguf package only dequantizes K-quants; their blocks are drawn at random (small scales, so the weights
# stay near HF's init scale) and the dequantized values become the reference weights.
K_QUANT_TYPES = ("Q4_K", "Q6_K")


def _random_k_quant_rows(rows: int, row_elems: int, qtype_name: str, rng: np.random.Generator) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * row_elems // block_elems, block_bytes), dtype=np.uint8)
    if qtype_name == "Q4_K":  # d, dmin (f16) then scales and nibbles: weights d*sc*q - dmin*m, |w| <~ 0.1
        blocks[:, 0:2] = np.full(len(blocks), 1e-4, np.float16).view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = np.full(len(blocks), 5e-5, np.float16).view(np.uint8).reshape(-1, 2)
    else:  # Q6_K: ql, qh, int8 scales, then d (f16): weights d*sc*(q-32)
        blocks[:, 208:210] = np.full(len(blocks), 2e-5, np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _write_llama_gguf(path: Path, hf_dir: Path, qtypes: tuple[str, ...], *, rope_freqs: np.ndarray | None = None):
    """The HF Llama at `hf_dir` written as a GGUF the way llama.cpp does (q/k rows permuted, 2-D tensors in
    `qtypes` cycled, no vocabulary; `rope_freqs` as llama.cpp stores Llama 3 scaling). Returns the HF model
    and the state dict it must be given so that it holds exactly the GGUF's dequantized weights, in HF layout
    (computed here independently of the converter), and the types used."""
    import gguf
    from gguf.quants import dequantize, quantize
    from transformers import AutoModelForCausalLM

    from checkpoints_convert.gguf_metadata import _LAYER_NAMES

    hf_config = json.loads((hf_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    names = {hf: g for g, hf in [("token_embd.weight", "model.embed_tokens.weight"),
                                  ("output_norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")]}
    for i in range(hf_config["num_hidden_layers"]):
        for g, hf in _LAYER_NAMES.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{g}"
    rope = hf_config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(hf_config["num_hidden_layers"])
    writer.add_context_length(hf_config["max_position_embeddings"])
    writer.add_embedding_length(hf_config["hidden_size"])
    writer.add_feed_forward_length(hf_config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(hf_config.get("rope_theta") or rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(hf_config["rms_norm_eps"])
    writer.add_vocab_size(hf_config["vocab_size"])
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    rng = np.random.default_rng(7)
    expected, types_used = {}, set()
    for k, (hf_name, w) in enumerate(sorted(state.items())):
        if hf_name not in names:  # tied: lm_head.weight is the embedding
            continue
        w = w.astype(np.float32)
        n_head = heads if hf_name.endswith("q_proj.weight") else kv_heads
        permuted = hf_name.endswith(("q_proj.weight", "k_proj.weight"))
        w_gguf = _llama_cpp_permute(w, n_head) if permuted else w
        name = qtypes[k % len(qtypes)] if w.ndim == 2 else "F32"
        qtype = gguf.GGMLQuantizationType[name]
        types_used.add(name)
        data = (_random_k_quant_rows(w.shape[0], w.shape[1], name, rng) if name in K_QUANT_TYPES
                else quantize(w_gguf, qtype))
        writer.add_tensor(names[hf_name], data, raw_dtype=qtype if name != "F32" else None)
        deq = dequantize(data, qtype).reshape(w.shape)
        if permuted:  # back to HF row order, independently of the converter: GGUF row r is HF row rows[r]
            rows = _llama_cpp_permute(np.arange(w.shape[0])[:, None], n_head)[:, 0]
            unpermuted = np.empty_like(deq)
            unpermuted[rows] = deq
            deq = unpermuted
        expected[hf_name] = torch.from_numpy(np.ascontiguousarray(deq))
    if "lm_head.weight" not in names.keys() & expected.keys() and "lm_head.weight" in state:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(expected)
    return model, types_used


def _relative_logit_error(out: Path, model, ids: list[int]) -> float:
    from checkpoints_convert.verifier import engine_logits

    ours = engine_logits(out, ids, "float32")
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].double().numpy()
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def test_synthetic_gguf_quant_types_permutation_untied_head(hf_checkpoint, tmp_path: Path) -> None:
    """The tiny HF Llama (GQA 4:2, untied LM head) as a GGUF with several quant types: the converted model's
    logits equal HF's on the dequantized weights."""
    model, types_used = _write_llama_gguf(tmp_path / "tiny.gguf", hf_checkpoint("llama"), SYNTHETIC_TYPES)
    assert {"F16", "BF16", "Q8_0", "Q4_0", "Q4_1"} <= types_used
    out = tmp_path / "out"
    assert main(["--gguf", str(tmp_path / "tiny.gguf"), "--out", str(out), "--quiet"]) == 0
    config = ModelConfig.from_pretrained(out)
    assert not config.tie_word_embeddings and config.num_key_value_heads == model.config.num_key_value_heads
    assert _relative_logit_error(out, model, list(range(3, 40))) <= 1e-4
    assert not (out / "tokenizer.json").exists()


def test_relative_gguf_and_out_paths(hf_checkpoint, tmp_path: Path, monkeypatch) -> None:
    """`--gguf tiny.gguf --out out` as the README types it (Orbax's atomic save refuses relative paths)."""
    _write_llama_gguf(tmp_path / "tiny.gguf", hf_checkpoint("llama"), ("F32",))
    monkeypatch.chdir(tmp_path)
    assert main(["--gguf", "tiny.gguf", "--out", "out", "--quiet"]) == 0
    assert ModelConfig.from_pretrained(tmp_path / "out").num_key_value_heads == 2


def test_synthetic_gguf_k_quants(hf_checkpoint, tmp_path: Path) -> None:
    """Q4_K and Q6_K tensors (256-value super-blocks: hidden 256, ffn 512), read in row chunks by the writer
    (chunk_bytes small enough to split every matrix): logits equal HF's on the same dequantized weights."""
    from checkpoints_convert.gguf_source import convert_gguf

    model, types_used = _write_llama_gguf(tmp_path / "k.gguf", hf_checkpoint("llama-256"), K_QUANT_TYPES)
    assert types_used == {"Q4_K", "Q6_K", "F32"}
    out = tmp_path / "out"
    convert_gguf(tmp_path / "k.gguf", out, "float32", log=lambda _: None, chunk_bytes=64 * 1024,
                 min_batch_bytes=1024)
    assert _relative_logit_error(out, model, list(range(3, 60))) <= 1e-4


def test_synthetic_gguf_llama3_rope_freqs(hf_checkpoint, tmp_path: Path) -> None:
    """Llama 3 RoPE scaling, which llama.cpp stores as `rope_freqs.weight` (one divisor per frequency): the
    converter recovers HF's `rope_parameters`, and the logits at positions past the original context (16) match
    HF's model that has the real llama3 scaling."""
    hf_dir = hf_checkpoint("llama3")
    hf_config = json.loads((hf_dir / "config.json").read_text())
    rope = hf_config["rope_parameters"]
    freqs = _llama3_rope_freqs(rope["rope_theta"], hf_config["hidden_size"] // hf_config["num_attention_heads"], rope)
    model, _ = _write_llama_gguf(tmp_path / "l3.gguf", hf_dir, ("F32",), rope_freqs=freqs)
    out = tmp_path / "out"
    assert main(["--gguf", str(tmp_path / "l3.gguf"), "--out", str(out), "--quiet"]) == 0
    converted = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert converted == {k: rope[k] for k in converted}, converted
    assert _relative_logit_error(out, model, list(range(3, 120))) <= 1e-4


def test_llama3_rope_parameters_of_released_models() -> None:
    """Llama 3.1 (head_dim 128, factor 8) and 3.2 (factor 32): the four HF numbers come back exactly; factors
    that follow no Llama 3 scheme are refused."""
    from checkpoints_convert.converter import ConversionError
    from checkpoints_convert.gguf_metadata import llama3_rope_parameters

    for head_dim, factor in ((128, 8.0), (64, 32.0)):
        scaling = dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
        got = llama3_rope_parameters(_llama3_rope_freqs(500000.0, head_dim, scaling), 500000.0, head_dim)
        assert got == {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}
    with pytest.raises(ConversionError, match="does not follow Llama 3"):
        llama3_rope_parameters(np.linspace(1.0, 3.0, 64, dtype=np.float32) ** 2, 500000.0, 128)
