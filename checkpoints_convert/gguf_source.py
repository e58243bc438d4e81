"""llama.cpp GGUF file -> the same Orbax checkpoint the safetensors path writes.

`python -m checkpoints_convert --gguf FILE.gguf --out DIR [--dtype float32|bfloat16]`

The file is read with the `gguf` package (llama.cpp's own reader, `gguf.GGUFReader`, which memory-maps it)
and every tensor is dequantized with `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K
and every other type that library implements). `GGUFCheckpoint` presents the tensors under their HF names and
HF shapes with the `info(name)` / `read_rows(info, r0, r1)` interface of `SafetensorsCheckpoint`, so the
parameter plan and the Orbax writer (`converter.write_checkpoint`) are the ones the safetensors path uses.
Tensors are dequantized in the row chunks the writer asks for (quant blocks never span rows); only the Q/K
matrices, whose rows llama.cpp permutes within each head, are dequantized whole (one cached at a time).

Metadata -> side files, written next to the params:
- `config.json` (`LlamaForCausalLM`) from the `llama.*` keys; the vocabulary size from the token list; tied
  embeddings when the file has no `output.weight`. Other architectures are refused with their name.
- `tokenizer.json`, built from the GGUF vocabulary by transformers' GGUF tokenizer converter (transformers is
  needed for this step only; a clear error says so when it is missing).
- `tokenizer_config.json` with the chat template (`tokenizer.chat_template`) and the special tokens.
- `generation_config.json` with the EOS id plus the end-of-turn ids (`tokenizer.ggml.eot_token_id` /
  `eom_token_id`, and well-known end-of-turn tokens that the chat template emits, e.g. `<|im_end|>`).

Q/K rows: llama.cpp's `convert_hf_to_gguf.py` permutes the rows of `q_proj` / `k_proj` (per head, from HF's
rotate-half layout to interleaved pairs); `_reverse_permute` undoes it exactly as transformers' GGUF loader
(`LlamaTensorProcessor._reverse_permute_weights`) does.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from checkpoints_convert.converter import (
    CHUNK_BYTES,
    DTYPES,
    MIN_BATCH_BYTES,
    ConversionError,
    ConversionResult,
    Log,
    _prepare_out,
    _release_free_memory,
    resolve_dtype,
    write_checkpoint,
)
from sarathi_jax.models.config import ModelConfig
from sarathi_jax.models.loader import CheckpointError

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

# GGUF tensor names (per layer after "blk.N.") -> HF names (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tokens that end an assistant turn in common chat templates; added to the stop ids when the template emits them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers' `_reverse_permute_weights`)."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def llama3_rope_parameters(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any]:
    """HF `rope_parameters` (rope_type "llama3") that reproduce llama.cpp's `rope_freqs.weight`.

    llama.cpp stores Llama 3's RoPE scaling as one divisor per frequency, `factors [head_dim // 2]`, not as the
    four HF numbers. The largest divisor is `factor`. In the blended band, `1 / f = (1 - s) / factor + s` with
    `s = (orig / wavelen - low) / (high - low)`, which is linear in `1 / wavelen`; its slope and intercept fix
    the band, and any (orig, low, high) with the same two give the same rotation. Llama 3's own low_freq_factor
    1 is taken, which recovers the released models' numbers exactly. With a single blended frequency the line
    is underdetermined and Llama 3's high_freq_factor 4 is taken too. The result is checked against `factors`
    through the model's own RoPE formula; a file that does not follow Llama 3's scheme is refused.
    """
    from sarathi_jax.models.config import RopeScaling
    from sarathi_jax.models.layers import rope_inv_freq

    factors = np.asarray(factors, np.float64)
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    inv_wavelen = inv_freq / (2 * np.pi)
    factor = float(factors.max())
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor) if factor > 1 else np.zeros_like(factors)
    middle = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if middle.sum() >= 2:
        slope, intercept = np.polyfit(inv_wavelen[middle], smooth[middle], 1)
        orig = round(-slope / intercept) if intercept < 0 else 0
        high = 1 + orig / slope if orig > 0 else 0.0
    elif middle.sum() == 1:
        orig, high = round(float((3 * smooth[middle][0] + 1) / inv_wavelen[middle][0])), 4.0
    else:
        orig, high = 0, 0.0
    if orig < 1 or not high > 1:
        raise ConversionError(f"rope_freqs.weight does not follow Llama 3's RoPE scaling (factors {factors.tolist()})")
    params = {"rope_type": "llama3", "rope_theta": rope_theta, "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": float(round(high, 6)), "original_max_position_embeddings": orig}
    scaling = RopeScaling(**{k: v for k, v in params.items() if k != "rope_theta"})
    expected = (inv_freq / factors).astype(np.float32)
    if not np.allclose(rope_inv_freq(head_dim, rope_theta, scaling), expected, rtol=1e-4, atol=0):
        raise ConversionError(f"rope_freqs.weight does not follow Llama 3's RoPE scaling (factors {factors.tolist()})")
    return params


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str  # HF name
    gguf_name: str
    shape: tuple[int, ...]  # HF shape (GGUF lists dimensions fastest-first: reversed)
    quant_type: str
    dtype: np.dtype = np.dtype(np.float32)  # what read_rows returns

    @property
    def row_elems(self) -> int:
        return math.prod(self.shape[1:])


class GGUFCheckpoint:
    """A GGUF file's tensors, dequantized to float32, under HF names (`SafetensorsCheckpoint`'s interface)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            import gguf
        except ImportError as e:  # pragma: no cover - gguf is a dependency
            raise ConversionError("reading GGUF files needs the `gguf` package: pip install gguf") from e
        self.path = Path(path)
        if not self.path.is_file():
            raise ConversionError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises ValueError / struct errors on garbage
            raise CheckpointError(f"cannot read GGUF file {str(self.path)!r}: {e}") from e
        self.files = [self.path]
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                       "tokenizer.ggml.scores"):
                continue  # large arrays: read on demand
            try:
                self.metadata[key] = field.contents()
            except Exception:  # noqa: BLE001 - a field the library cannot decode is not one we use
                pass
        self.architecture = self.metadata.get("general.architecture")
        if self.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ConversionError(
                f"GGUF architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (Llama family)"
            )
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._infos: dict[str, GGUFTensorInfo] = {}
        for t in self.reader.tensors:
            hf_name = gguf_to_hf_name(t.name)
            if hf_name is None:
                continue
            shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
            self._infos[hf_name] = GGUFTensorInfo(hf_name, t.name, shape, t.tensor_type.name)
        self._cache: tuple[str, np.ndarray] | None = None

    # -- metadata -------------------------------------------------------------------------------------------
    def _meta(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def _field_list(self, key: str) -> list[Any]:
        field = self.reader.fields.get(key)
        return [] if field is None else list(field.contents())

    @property
    def tokens(self) -> list[str]:
        if not hasattr(self, "_tokens"):
            self._tokens = self._field_list("tokenizer.ggml.tokens")
        return self._tokens

    @property
    def num_heads(self) -> int:
        return int(self._meta("attention.head_count"))

    @property
    def num_kv_heads(self) -> int:
        return int(self._meta("attention.head_count_kv", self.num_heads))

    def hf_config(self) -> dict[str, Any]:
        """An HF `config.json` (LlamaForCausalLM, transformers 5 layout) from the `llama.*` metadata."""
        hidden = int(self._meta("embedding_length"))
        head_dim = int(self._meta("attention.key_length", hidden // self.num_heads))
        rope_dim = self._meta("rope.dimension_count")
        if rope_dim is not None and int(rope_dim) != head_dim:
            raise ConversionError(f"partial rotary embeddings (rope.dimension_count {rope_dim} != head_dim "
                                  f"{head_dim}) are not supported")
        scaling = self._meta("rope.scaling.type")
        if scaling not in (None, "none"):
            raise ConversionError(f"GGUF rope scaling {scaling!r} is not supported (only Llama 3's, stored as "
                                  "rope_freqs.weight)")
        rope_theta = float(self._meta("rope.freq_base", 10000.0))
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
        if "rope_freqs.weight" in self._tensors:
            t = self._tensors["rope_freqs.weight"]
            factors = np.asarray(t.data, np.float32).reshape(-1)
            if t.tensor_type.name != "F32" or factors.shape != (head_dim // 2,):
                raise ConversionError(f"rope_freqs.weight: expected {head_dim // 2} F32 values, got "
                                      f"{factors.shape} {t.tensor_type.name}")
            rope_parameters = llama3_rope_parameters(factors, rope_theta, head_dim)
        vocab_size = len(self.tokens) or int(self._meta("vocab_size"))
        emb = self._infos.get("model.embed_tokens.weight")
        if emb is not None and emb.shape[0] != vocab_size:
            vocab_size = emb.shape[0]
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": int(self._meta("feed_forward_length")),
            "num_hidden_layers": int(self._meta("block_count")),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon", 1e-5)),
            "max_position_embeddings": int(self._meta("context_length", 2048)),
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": "lm_head.weight" not in self._infos,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.metadata.get("tokenizer.ggml.padding_token_id"),
            # Dequantized weights are float32 values: keep them exact unless --dtype says otherwise.
            "dtype": "float32",
        }
        if self.metadata.get("general.name"):
            config["_name_or_path"] = self.metadata["general.name"]
        return config

    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    def stop_token_ids(self) -> list[int]:
        """EOS, then the end-of-turn ids: `eot_token_id` / `eom_token_id`, and known end-of-turn tokens that
        the chat template writes."""
        ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self.metadata.get(f"tokenizer.ggml.{key}")
            if value is not None and int(value) not in ids:
                ids.append(int(value))
        template = self.chat_template() or ""
        if template:
            index = {tok: i for i, tok in enumerate(self.tokens)} if self.tokens else {}
            for token in END_OF_TURN_TOKENS:
                if token in template and token in index and index[token] not in ids:
                    ids.append(index[token])
        return ids

    def drop_vocabulary(self) -> None:
        """Free the reader's parsed vocabulary arrays (a Python object per token and merge): tens of MB."""
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores"):
            self.reader.fields.pop(key, None)
        self.__dict__.pop("_tokens", None)

    def token(self, key: str) -> str | None:
        token_id = self.metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None or not self.tokens or not 0 <= int(token_id) < len(self.tokens):
            return None
        return self.tokens[int(token_id)]

    # -- tensors (SafetensorsCheckpoint's interface) ---------------------------------------------------------
    def info(self, name: str) -> GGUFTensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} not found in GGUF file {str(self.path)!r}") from None

    def tensor(self, info: GGUFTensorInfo) -> np.ndarray:
        """The whole tensor, dequantized to float32 in HF layout (q/k rows un-permuted); one is cached."""
        if self._cache is not None and self._cache[0] == info.name:
            return self._cache[1]
        self._cache = None
        from gguf.quants import dequantize

        t = self._tensors[info.gguf_name]
        try:
            array = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(
                f"tensor {t.name!r}: the gguf library cannot dequantize type {t.tensor_type.name}: {e}"
            ) from None
        array = np.ascontiguousarray(np.asarray(array, dtype=np.float32).reshape(info.shape))
        if info.gguf_name.endswith("attn_q.weight"):
            array = _reverse_permute(array, self.num_heads)
        elif info.gguf_name.endswith("attn_k.weight"):
            array = _reverse_permute(array, self.num_kv_heads)
        self._cache = (info.name, array)
        return array

    def read_rows(self, info: GGUFTensorInfo, start: int, stop: int) -> np.ndarray:
        """Rows start..stop as float32. Q/K (rows permuted within each head) come from the whole dequantized
        tensor, cached; every other tensor dequantizes just those rows (GGUF quant blocks never span rows), so
        a large embedding is never whole in float32 here."""
        if info.gguf_name.endswith(("attn_q.weight", "attn_k.weight")) or len(info.shape) <= 1:
            array = self.tensor(info)
            return array[start:stop] if info.shape else array.reshape(1)
        from gguf.quants import dequantize

        t = self._tensors[info.gguf_name]
        data = t.data.reshape(info.shape[0], -1)  # one row of blocks (or of values) per HF row
        try:
            rows = dequantize(data[start:stop], t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(
                f"tensor {t.name!r}: the gguf library cannot dequantize type {t.tensor_type.name}: {e}"
            ) from None
        return np.asarray(rows, dtype=np.float32).reshape(stop - start, *info.shape[1:])


def write_tokenizer_files(checkpoint: GGUFCheckpoint, out: Path) -> None:
    """`tokenizer.json` (through transformers' GGUF tokenizer converter) and `tokenizer_config.json`."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError as e:
        raise ConversionError(
            "building tokenizer.json from a GGUF vocabulary needs HF transformers (>= 5, with its GGUF "
            "tokenizer converter): pip install transformers"
        ) from e
    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(checkpoint.path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    backend.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {k: v for k, v in tokenizer_config.items() if v is not None}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token = checkpoint.token(key)
        if token is not None:
            config.setdefault(name, token)
    if "tokenizer.ggml.add_bos_token" in checkpoint.metadata:
        config["add_bos_token"] = bool(checkpoint.metadata["tokenizer.ggml.add_bos_token"])
    template = checkpoint.chat_template()
    if template:
        config["chat_template"] = template
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(
    gguf_file: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str | None = None,
    *,
    force: bool = False,
    log: Log = print,
    chunk_bytes: int = CHUNK_BYTES,
    min_batch_bytes: int = MIN_BATCH_BYTES,
    compress: bool = False,
) -> ConversionResult:
    """Convert a GGUF file into an Orbax checkpoint folder `out_dir` (see module doc)."""
    start_time = time.monotonic()
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if out_dir.resolve() in gguf_file.resolve().parents:  # --force would replace (delete) the input file
        raise ConversionError(f"--out {str(out_dir)!r} must not contain the GGUF file")
    _prepare_out(None, out_dir, force)  # before parsing the file (seconds for a large vocabulary)
    checkpoint = GGUFCheckpoint(gguf_file)
    hf_config = checkpoint.hf_config()
    try:
        config = ModelConfig.from_hf_config(hf_config)
    except (ValueError, KeyError) as e:
        raise ConversionError(f"cannot convert {str(gguf_file)!r}: {e}") from e
    dtype = resolve_dtype(config, dtype)
    with tempfile.TemporaryDirectory(prefix="gguf-side-") as side:
        side_dir = Path(side)
        (side_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        generation_config = {"bos_token_id": hf_config["bos_token_id"], "eos_token_id": checkpoint.stop_token_ids()}
        (side_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
        if checkpoint.tokens:
            write_tokenizer_files(checkpoint, side_dir)
        else:
            log("the GGUF file has no vocabulary (tokenizer.ggml.tokens): no tokenizer.json, prompts must be token ids")
        config = ModelConfig.from_pretrained(side_dir)  # with the end-of-turn ids
        checkpoint.drop_vocabulary()  # the reader's per-token fields and the tokenizer build are done with
        gc.collect()
        _release_free_memory()
        types = sorted({info.quant_type for info in checkpoint._infos.values()})
        return write_checkpoint(
            config, checkpoint, out_dir, dtype, side_dir=side_dir, source_path=str(gguf_file.resolve()),
            source_desc=f"GGUF {str(gguf_file)!r} ({', '.join(types)})", log=log, chunk_bytes=chunk_bytes,
            min_batch_bytes=min_batch_bytes, compress=compress, start_time=start_time,
        )


__all__ = ["GGUFCheckpoint", "SUPPORTED_GGUF_ARCHITECTURES", "convert_gguf", "gguf_to_hf_name"]
