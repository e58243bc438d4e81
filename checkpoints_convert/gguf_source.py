"""llama.cpp GGUF file -> the same Orbax checkpoint the safetensors path writes.

`python -m checkpoints_convert --gguf FILE.gguf --out DIR [--dtype float32|bfloat16] [--quantization int8]`

The file is read with the `gguf` package (llama.cpp's own reader, `gguf.GGUFReader`, which memory-maps it)
and every tensor is dequantized with `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K
and every other type that library implements). `GGUFCheckpoint` presents the tensors under their HF names and
HF shapes with the `info(name)` / `read_rows(info, r0, r1)` interface of `SafetensorsCheckpoint`, so the
parameter plan and the Orbax writer (`orbax_writer.write_checkpoint`) are the ones the safetensors path uses.
Tensors are dequantized in the row chunks the writer asks for (quant blocks never span rows); only the Q/K
matrices, whose rows llama.cpp permutes within each head, are dequantized whole (one cached at a time).
With `--quantization int8` the writer quantizes the dequantized projections again, per output channel (one
float32 scale per row, not the file's per-block scales): the values the float conversion would hold, quantized
as `quantization="int8"` would at load.

Metadata -> side files, written next to the params (gguf_metadata.py):
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
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Unpack

import numpy as np

from checkpoints_convert.converter import (
    DTYPES,
    ConversionError,
    ConvertOptions,
    OpenedSource,
    prepare_out,
    resolve_dtype,
    run_conversion,
)
from checkpoints_convert.gguf_metadata import gguf_to_hf_name, stop_token_ids, write_tokenizer_files
from checkpoints_convert.gguf_metadata import hf_config as gguf_hf_config
from checkpoints_convert.orbax_writer import ConversionResult, Log, release_free_memory
from sarathi_jax.models.config import ModelConfig
from sarathi_jax.models.loader import CheckpointError

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
# The vocabulary's large array fields: not decoded up front, dropped once the tokenizer is built.
_VOCABULARY_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                      "tokenizer.ggml.scores")

def _reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers' `_reverse_permute_weights`)."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


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
            if key in _VOCABULARY_FIELDS:
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
        self.raw_tensors = {t.name: t for t in self.reader.tensors}
        self.infos: dict[str, GGUFTensorInfo] = {}
        for t in self.reader.tensors:
            hf_name = gguf_to_hf_name(t.name)
            if hf_name is None:
                continue
            shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
            self.infos[hf_name] = GGUFTensorInfo(hf_name, t.name, shape, t.tensor_type.name)
        self._cache: tuple[str, np.ndarray] | None = None

    # -- metadata -------------------------------------------------------------------------------------------
    def meta(self, key: str, default: Any = None) -> Any:
        """The architecture's metadata value `key` (e.g. "block_count" reads "llama.block_count")."""
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
        return int(self.meta("attention.head_count"))

    @property
    def num_kv_heads(self) -> int:
        return int(self.meta("attention.head_count_kv", self.num_heads))

    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    def drop_vocabulary(self) -> None:
        """Free the reader's parsed vocabulary arrays (a Python object per token and merge): tens of MB."""
        for key in _VOCABULARY_FIELDS:
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
            return self.infos[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} not found in GGUF file {str(self.path)!r}") from None

    def tensor(self, info: GGUFTensorInfo) -> np.ndarray:
        """The whole tensor, dequantized to float32 in HF layout (q/k rows un-permuted); one is cached."""
        if self._cache is not None and self._cache[0] == info.name:
            return self._cache[1]
        self._cache = None
        from gguf.quants import dequantize

        t = self.raw_tensors[info.gguf_name]
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

        t = self.raw_tensors[info.gguf_name]
        data = t.data.reshape(info.shape[0], -1)  # one row of blocks (or of values) per HF row
        try:
            rows = dequantize(data[start:stop], t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(
                f"tensor {t.name!r}: the gguf library cannot dequantize type {t.tensor_type.name}: {e}"
            ) from None
        return np.asarray(rows, dtype=np.float32).reshape(stop - start, *info.shape[1:])


def convert_gguf(gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str | None = None,
                 **options: Unpack[ConvertOptions]) -> ConversionResult:
    """Convert a GGUF file into an Orbax checkpoint folder `out_dir` (see module doc)."""
    return run_conversion(gguf_file, out_dir, dtype, _open_gguf_file, **options)


@contextmanager
def _open_gguf_file(gguf_file: Path, out_dir: Path, dtype: str | None, force: bool, log: Log) -> Iterator[OpenedSource]:
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if out_dir.resolve() in gguf_file.resolve().parents:  # --force would replace (delete) the input file
        raise ConversionError(f"--out {str(out_dir)!r} must not contain the GGUF file")
    prepare_out(None, out_dir, force)  # before parsing the file (seconds for a large vocabulary)
    checkpoint = GGUFCheckpoint(gguf_file)
    hf_config = gguf_hf_config(checkpoint)
    try:
        config = ModelConfig.from_hf_config(hf_config)
    except (ValueError, KeyError) as e:
        raise ConversionError(f"cannot convert {str(gguf_file)!r}: {e}") from e
    dtype = resolve_dtype(config, dtype)
    with tempfile.TemporaryDirectory(prefix="gguf-side-") as side:
        side_dir = Path(side)
        (side_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        generation_config = {"bos_token_id": hf_config["bos_token_id"], "eos_token_id": stop_token_ids(checkpoint)}
        (side_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
        if checkpoint.tokens:
            write_tokenizer_files(checkpoint, side_dir)
        else:
            log("the GGUF file has no vocabulary (tokenizer.ggml.tokens): no tokenizer.json, prompts must be token ids")
        config = ModelConfig.from_pretrained(side_dir)  # with the end-of-turn ids
        checkpoint.drop_vocabulary()  # the reader's per-token fields and the tokenizer build are done with
        gc.collect()
        release_free_memory()
        types = sorted({info.quant_type for info in checkpoint.infos.values()})
        yield OpenedSource(config, dtype, checkpoint, side_dir, f"GGUF {str(gguf_file)!r} ({', '.join(types)})")


__all__ = ["GGUFCheckpoint", "SUPPORTED_GGUF_ARCHITECTURES", "convert_gguf", "gguf_to_hf_name"]
