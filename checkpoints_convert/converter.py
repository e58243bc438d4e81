"""HF safetensors folder -> Orbax checkpoint of the engine's parameter tree, streamed parameter by parameter.

`orbax_writer.write_checkpoint` is the one writer: `convert` feeds it a `SafetensorsCheckpoint`,
`gguf_source.convert_gguf` a `GGUFCheckpoint` (same `info` / `read_rows` interface, tensors under HF names), and
`param_reader.read_param` reads each parameter out of either. This module holds the input and output checks and
the safetensors entry point.

Output folder layout (what `sarathi_jax.models.load_model` recognizes):

    OUT/params/...                 Orbax PyTree checkpoint of the params (OCDBT), written with
                                   `orbax.checkpoint.experimental.v1.partial.save` + `partial.finalize`
    OUT/config.json, generation_config.json, tokenizer.json, ...   copied from the HF folder
    OUT/sarathi_checkpoint.json    completion marker, written last: format, dtype, every param's shape

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
(Batching small parameters keeps the number of partial saves low: each partial save re-reads the metadata of
the earlier ones, so their cost grows quadratically with their count.)

Atomicity: everything is written into a hidden sibling `.<name>.converting` and renamed to OUT at the end;
the marker is the last file written before the rename. An interrupted run leaves at most that sibling
(no marker, refused by `load_model`, removed by the next run), never a complete-looking OUT.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

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
from sarathi_jax.paths import absolute_path

DTYPES = ("bfloat16", "float32")


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


def convert(
    hf_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str | None = None,
    *,
    force: bool = False,
    log: Log = print,
    chunk_bytes: int = CHUNK_BYTES,
    min_batch_bytes: int = MIN_BATCH_BYTES,
    compress: bool = False,
) -> ConversionResult:
    """Convert the HF checkpoint folder `hf_dir` into an Orbax checkpoint folder `out_dir` (see module doc)."""
    start_time = time.monotonic()
    # Absolute from here on: Orbax's atomic save refuses relative destinations.
    hf_dir, out_dir = Path(absolute_path(hf_dir)), Path(absolute_path(out_dir))
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{str(hf_dir)!r} is not an HF checkpoint folder (no config.json)")
    try:
        config = ModelConfig.from_pretrained(hf_dir)
    except (ValueError, KeyError) as e:
        raise ConversionError(f"cannot convert {str(hf_dir)!r}: {e}") from e
    dtype = resolve_dtype(config, dtype)
    prepare_out(hf_dir, out_dir, force)
    checkpoint = SafetensorsCheckpoint(hf_dir)
    return write_checkpoint(
        config, checkpoint, out_dir, dtype, side_dir=hf_dir, source_path=str(hf_dir.resolve()),
        source_desc=f"{str(hf_dir)!r}, {len(checkpoint.files)} safetensors file(s)", log=log,
        chunk_bytes=chunk_bytes, min_batch_bytes=min_batch_bytes, compress=compress, start_time=start_time,
    )


__all__ = ["ConversionError", "ConversionResult", "SUPPORTED_ARCHITECTURES", "TensorSource", "convert", "read_param",
           "write_checkpoint"]
