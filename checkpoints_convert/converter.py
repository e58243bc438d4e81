"""HF safetensors folder -> Orbax checkpoint of the engine's parameter tree, streamed parameter by parameter.

`orbax_writer.write_checkpoint` is the one writer: `convert` feeds it a `SafetensorsCheckpoint`,
`gguf_source.convert_gguf` a `GGUFCheckpoint` (same `info` / `read_rows` interface, tensors under HF names), and
`param_reader.read_param` reads each parameter out of either. This module holds the input and output checks, the
frame both entry points run in (`run_conversion`) and the safetensors entry point.

Output folder layout (what `sarathi_jax.models.load_model` recognizes):

    OUT/params/...                 Orbax PyTree checkpoint of the params (OCDBT), written with
                                   `orbax.checkpoint.experimental.v1.partial.save` + `partial.finalize`
    OUT/config.json, generation_config.json, tokenizer.json, ...   copied from the HF folder
    OUT/sarathi_checkpoint.json    completion marker, written last: format, dtype, quantization (null or
                                   "int8"), every param's shape and stored dtype

Memory: the plan (`sarathi_jax.models.param_plan`) says, per parameter (per layer for the decoder layers,
whose parameters are stacked on a leading layers axis), which HF tensor rows it takes and whether it is
transposed. Each parameter is assembled directly in the target dtype, layer by layer into its stacked array,
from chunks of at most `chunk_bytes` read with plain file reads (`safetensors_stream`), so the HF tensor and
its transposed copy never coexist. A stacked parameter holds all layers of one matrix (for Mistral-7B in
bfloat16 the largest, an MLP matrix, is 3.5 GiB), which bounds the peak. Parameters are handed to Orbax in batches of at most `max(largest parameter, min_batch_bytes)` bytes,
one `partial.save` per batch, with Orbax's defensive host copy switched off (`deepcopy_host_arrays=False`)
and, unless `compress=True`, without zstd compression (its per-thread buffers were most of the peak).
Peak host memory above the import baseline is therefore about one batch (<= the largest parameter, or
`min_batch_bytes` for small models) plus one read chunk plus Orbax/TensorStore's own working set.
With `quantization="int8"` (`--quantization int8`) each projection is assembled int8 with its float32 scales,
one layer at a time through a float32 scratch of one layer (`orbax_writer`), within the same bound; fp8 is
refused (`check_conversion_quantization`: it is chosen at load, on FP8 GPUs).
(Batching small parameters keeps the number of partial saves low: each partial save re-reads the metadata of
the earlier ones, so their cost grows quadratically with their count.)

Atomicity: everything is written into a hidden sibling `.<name>.converting` and renamed to OUT at the end;
the marker is the last file written before the rename. An interrupted run leaves at most that sibling
(no marker, refused by `load_model`, removed by the next run), never a complete-looking OUT.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, Unpack

from checkpoints_convert.orbax_writer import (  # noqa: F401  (COPIED_FILES, ConversionResult re-exported)
    COPIED_FILES,
    MIN_BATCH_BYTES,
    ConversionResult,
    Log,
    write_checkpoint,
)
from checkpoints_convert.param_reader import CHUNK_BYTES, TensorSource, read_param  # noqa: F401  (re-exported)
from checkpoints_convert.safetensors_stream import SafetensorsCheckpoint
from sarathi_jax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from sarathi_jax.models.loader import is_orbax_checkpoint
from sarathi_jax.utils.paths import absolute_path

DTYPES = ("bfloat16", "float32")
# `--quantization` values a conversion writes; fp8 is refused (`check_conversion_quantization` says why).
QUANTIZATIONS = ("int8",)


class ConversionError(ValueError):
    """The conversion cannot start: unsupported model, bad input folder, or an output folder in the way."""


def default_dtype(config: ModelConfig) -> str:
    """The checkpoint's own dtype when it is one of ours; 16-bit checkpoints become bfloat16."""
    return "float32" if config.torch_dtype in (None, "float32", "float64") else "bfloat16"


def resolve_dtype(config: ModelConfig, dtype: str | None) -> str:
    if dtype is None:
        dtype = default_dtype(config)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def check_conversion_quantization(quantization: str | None) -> None:
    """ConversionError unless `quantization` is None or one a converted folder can hold (`QUANTIZATIONS`)."""
    if quantization == "fp8":
        raise ConversionError(
            "--quantization fp8 is not written by the converter: fp8 weights run only on GPUs with FP8 matmul "
            "(compute capability 8.9+), so fp8 is chosen at load on such GPUs (quantization='fp8' on the float "
            "folder: the same values, quantized as they are restored); convert with --quantization int8, or "
            "without --quantization"
        )
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConversionError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")


def _looks_like_checkpoint(path: Path) -> bool:
    return is_orbax_checkpoint(path) or (path / "config.json").exists() or any(path.glob("*.safetensors"))


def prepare_out(hf_dir: Path | None, out_dir: Path, force: bool) -> None:
    """Refuse an output folder that is (or is inside) the input, is a file, or is not empty (unless `force`)."""
    if hf_dir is not None and (out_dir.resolve() == hf_dir.resolve() or hf_dir.resolve() in out_dir.resolve().parents):
        raise ConversionError(f"--out {str(out_dir)!r} must not be the HF folder or inside it")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"output path {str(out_dir)!r} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        if _looks_like_checkpoint(out_dir):
            raise ConversionError(
                f"output folder {str(out_dir)!r} already holds a checkpoint; pass --force to replace it"
            )
        raise ConversionError(f"output folder {str(out_dir)!r} is not empty; pass --force to replace it")


class ConvertOptions(TypedDict, total=False):
    """What every entry point (`convert`, `gguf_source.convert_gguf`) takes beside its input, the output folder
    and the dtype; defaults in `run_conversion`."""

    force: bool  # replace an output folder that is not empty
    log: Log  # progress lines
    chunk_bytes: int  # the largest read of one tensor's rows
    min_batch_bytes: int  # parameters handed to Orbax per partial save, at the least
    compress: bool  # zstd-compress the stored arrays
    quantization: str | None  # "int8": the decoder layers' projections stored int8 + float32 scales


@dataclass(frozen=True)
class OpenedSource:
    """An input checked and opened: its model config, the dtype to write, its tensors, the folder holding its
    side files (config.json, tokenizer files, ...) and how the summary names it."""

    config: ModelConfig
    dtype: str
    checkpoint: TensorSource
    side_dir: Path
    description: str


# (absolute input path, absolute output folder, dtype asked for or None, force, log) -> the opened input; a
# context manager so that an input may keep temporary side files until the checkpoint is written.
OpenSource = Callable[[Path, Path, "str | None", bool, Log], AbstractContextManager[OpenedSource]]


def run_conversion(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str | None,
    open_source: OpenSource,
    *,
    force: bool = False,
    log: Log = print,
    chunk_bytes: int = CHUNK_BYTES,
    min_batch_bytes: int = MIN_BATCH_BYTES,
    compress: bool = False,
    quantization: str | None = None,
) -> ConversionResult:
    """The entry points' common frame: time the whole run, make both paths absolute (Orbax's atomic save
    refuses relative destinations), let `open_source` check and open the input, then write the checkpoint
    (with `quantization`, its projections quantized: `orbax_writer`)."""
    start_time = time.monotonic()
    check_conversion_quantization(quantization)
    source, out_dir = Path(absolute_path(source)), Path(absolute_path(out_dir))
    with open_source(source, out_dir, dtype, force, log) as opened:
        return write_checkpoint(
            dataclasses.replace(opened.config, quantization=quantization), opened.checkpoint, out_dir, opened.dtype,
            side_dir=opened.side_dir, source_path=str(source.resolve()), source_desc=opened.description, log=log,
            chunk_bytes=chunk_bytes, min_batch_bytes=min_batch_bytes, compress=compress, start_time=start_time,
        )


def convert(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str | None = None,
            **options: Unpack[ConvertOptions]) -> ConversionResult:
    """Convert the HF checkpoint folder `hf_dir` into an Orbax checkpoint folder `out_dir` (see module doc)."""
    return run_conversion(hf_dir, out_dir, dtype, _open_hf_folder, **options)


@contextmanager
def _open_hf_folder(hf_dir: Path, out_dir: Path, dtype: str | None, force: bool, log: Log) -> Iterator[OpenedSource]:
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{str(hf_dir)!r} is not an HF checkpoint folder (no config.json)")
    try:
        config = ModelConfig.from_pretrained(hf_dir)
    except (ValueError, KeyError) as e:
        raise ConversionError(f"cannot convert {str(hf_dir)!r}: {e}") from e
    dtype = resolve_dtype(config, dtype)
    prepare_out(hf_dir, out_dir, force)
    checkpoint = SafetensorsCheckpoint(hf_dir)
    description = f"{str(hf_dir)!r}, {len(checkpoint.files)} safetensors file(s)"
    yield OpenedSource(config, dtype, checkpoint, hf_dir, description)


__all__ = ["ConversionError", "ConversionResult", "ConvertOptions", "OpenedSource", "QUANTIZATIONS",
           "SUPPORTED_ARCHITECTURES", "TensorSource", "check_conversion_quantization", "convert", "read_param",
           "run_conversion", "write_checkpoint"]
