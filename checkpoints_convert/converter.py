"""HF safetensors folder -> Orbax checkpoint of the engine's parameter tree, streamed parameter by parameter.

`write_checkpoint` is the one writer: `convert` feeds it a `SafetensorsCheckpoint`, `gguf_source.convert_gguf`
a `GGUFCheckpoint` (same `info` / `read_rows` interface, tensors under HF names).

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

import ctypes
import dataclasses
import datetime
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from checkpoints_convert.safetensors_stream import SafetensorsCheckpoint
from sarathi_jax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from sarathi_jax.models.families import param_plan
from sarathi_jax.models.loader import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_FORMAT_VERSION,
    CHECKPOINT_MARKER,
    ORBAX_PARAMS_DIR,
    CheckpointError,
    is_orbax_checkpoint,
    param_path_str,
)
from sarathi_jax.models.param_source import ParamSource

DTYPES = ("bfloat16", "float32")
# Copied next to the params when present: model config and everything `tokenizers` / HF tokenizers read.
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
CHUNK_BYTES = 8 << 20
MIN_BATCH_BYTES = 32 << 20

Log = Callable[[str], None]


class ConversionError(ValueError):
    """The conversion cannot start: unsupported model, bad input folder, or an output folder in the way."""


@dataclasses.dataclass
class ConversionResult:
    out_dir: Path
    config: ModelConfig
    dtype: str
    num_params: int  # parameter count (elements)
    num_bytes: int  # bytes written (in `dtype`)
    largest_param_bytes: int
    num_saves: int  # Orbax partial saves
    seconds: float


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def default_dtype(config: ModelConfig) -> str:
    """The checkpoint's own dtype when it is one of ours; 16-bit checkpoints become bfloat16."""
    return "float32" if config.torch_dtype in (None, "float32", "float64") else "bfloat16"


class TensorSource(Protocol):
    """What the writer reads tensors through: `SafetensorsCheckpoint`, or `gguf_source.GGUFCheckpoint`.
    `info(name)` has `.shape`, `.dtype`, `.row_elems`; `read_rows(info, r0, r1)` returns rows r0..r1."""

    def info(self, name: str) -> Any: ...

    def read_rows(self, info: Any, start: int, stop: int) -> np.ndarray: ...


def resolve_dtype(config: ModelConfig, dtype: str | None) -> str:
    if dtype is None:
        dtype = default_dtype(config)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def read_param(checkpoint: TensorSource, source: ParamSource, dtype: np.dtype,
               chunk_bytes: int = CHUNK_BYTES, out: np.ndarray | None = None) -> np.ndarray:
    """Assemble one parameter in `dtype` from its HF tensor, `chunk_bytes` of rows at a time.

    Same result as `source.apply(full_tensor).astype(dtype)`, but only the output array and one chunk are
    ever in memory: rows are copied (transposed when the plan says so) straight into the output, which is
    `out` when given (a C-contiguous `source.shape` array, e.g. one layer's slice of a stacked parameter).
    """
    info = checkpoint.info(source.name)
    if info.shape != source.hf_shape:
        raise CheckpointError(
            f"tensor {source.name!r} has shape {info.shape}, expected {source.hf_shape} for this config"
        )
    if not np.issubdtype(info.dtype, np.floating) and info.dtype.kind != "V":
        raise CheckpointError(f"tensor {source.name!r} has non-float dtype {info.dtype}")
    ranges = source.rows if source.rows is not None else ((0, info.shape[0] if info.shape else 1),)
    num_rows, row_elems = source.num_rows, info.row_elems
    if source.transpose:
        if len(info.shape) != 2:
            raise CheckpointError(f"tensor {source.name!r} should be a matrix, got shape {info.shape}")
        work_shape = (row_elems, num_rows)
    else:
        work_shape = (num_rows, row_elems) if len(info.shape) > 1 else (num_rows,)
    if out is None:
        out = np.empty(work_shape, dtype)
    else:
        if out.shape != source.shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {source.shape} {dtype} array, got {out.shape} {out.dtype}")
        out = out.reshape(work_shape)  # a view: rows land in the caller's array
    rows_per_chunk = max(1, chunk_bytes // max(1, row_elems * info.dtype.itemsize))
    done = 0
    for start, stop in ranges:
        for r0 in range(start, stop, rows_per_chunk):
            r1 = min(stop, r0 + rows_per_chunk)
            chunk = checkpoint.read_rows(info, r0, r1)
            if source.transpose:
                out[:, done : done + r1 - r0] = chunk.T
            else:
                out[done : done + r1 - r0] = chunk
            done += r1 - r0
            del chunk
    return out.reshape(source.shape)


def _check_plan(checkpoint: TensorSource, plan: list[ParamSource]) -> None:
    """Every tensor the model needs exists with the right shape: checked from the headers before writing."""
    for source in plan:
        info = checkpoint.info(source.name)
        if info.shape != source.hf_shape:
            raise CheckpointError(
                f"tensor {source.name!r} has shape {info.shape}, expected {source.hf_shape} for this config"
            )


def _group_layers(plan: list[ParamSource]) -> list[list[ParamSource]]:
    """The plan's sources grouped by output parameter, in first-appearance order; a stacked parameter's
    group holds its layers in order."""
    groups: dict[tuple[str, ...], list[ParamSource]] = {}
    for source in plan:
        groups.setdefault(source.param_path, []).append(source)
    for group in groups.values():
        if group[0].layer is not None and [s.layer for s in group] != list(range(len(group))):
            raise AssertionError(f"layers of {param_path_str(group[0].param_path)} are not 0..n-1 in order")
    return list(groups.values())


def _stacked_shape(group: list[ParamSource]) -> tuple[int, ...]:
    return group[0].shape if group[0].layer is None else (len(group), *group[0].shape)


def _looks_like_checkpoint(path: Path) -> bool:
    return is_orbax_checkpoint(path) or (path / "config.json").exists() or any(path.glob("*.safetensors"))


def _prepare_out(hf_dir: Path | None, out_dir: Path, force: bool) -> None:
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


def _release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc only; a no-op elsewhere).

    TensorStore encodes and writes chunks on its own threads, whose malloc arenas keep freed buffers; without
    trimming, the resident set ratchets up by about a batch per save even though nothing is referenced.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _nest(items: list[tuple[tuple[str, ...], np.ndarray]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, array in items:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array
    return tree


def _marker_json(marker: dict[str, Any]) -> str:
    """Indented JSON with one line per parameter."""
    head = {k: v for k, v in marker.items() if k != "params"}
    params = ",\n".join(f"  {json.dumps(name)}: {json.dumps(info)}" for name, info in marker["params"].items())
    return json.dumps(head, indent=1)[:-2] + ',\n "params": {\n' + params + "\n }\n}\n"


def _find_pytree_dir(params_dir: Path) -> Path:
    """The folder of the Orbax PyTree (the one holding `_METADATA`), relative to the output folder."""
    candidates = sorted(p.parent for p in params_dir.rglob("_METADATA"))
    if len(candidates) != 1:
        raise CheckpointError(f"expected one Orbax PyTree under {str(params_dir)!r}, found {candidates}")
    return candidates[0].relative_to(params_dir.parent)


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
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{str(hf_dir)!r} is not an HF checkpoint folder (no config.json)")
    try:
        config = ModelConfig.from_pretrained(hf_dir)
    except (ValueError, KeyError) as e:
        raise ConversionError(f"cannot convert {str(hf_dir)!r}: {e}") from e
    dtype = resolve_dtype(config, dtype)
    _prepare_out(hf_dir, out_dir, force)
    checkpoint = SafetensorsCheckpoint(hf_dir)
    return write_checkpoint(
        config, checkpoint, out_dir, dtype, side_dir=hf_dir, source_path=str(hf_dir.resolve()),
        source_desc=f"{str(hf_dir)!r}, {len(checkpoint.files)} safetensors file(s)", log=log,
        chunk_bytes=chunk_bytes, min_batch_bytes=min_batch_bytes, compress=compress, start_time=start_time,
    )


def write_checkpoint(
    config: ModelConfig,
    checkpoint: TensorSource,
    out_dir: Path,
    dtype: str,
    *,
    side_dir: Path,
    source_path: str,
    source_desc: str,
    log: Log = print,
    chunk_bytes: int = CHUNK_BYTES,
    min_batch_bytes: int = MIN_BATCH_BYTES,
    compress: bool = False,
    start_time: float | None = None,
) -> ConversionResult:
    """The one writer behind every input format: read each planned parameter from `checkpoint` (anything with
    `SafetensorsCheckpoint`'s `info(name)` / `read_rows(info, r0, r1)`, tensors named and shaped as in HF),
    write the Orbax PyTree, copy the side files (`COPIED_FILES`) found in `side_dir`, then the marker, and
    rename into place. The caller has checked the output folder (`_prepare_out`) and resolved `dtype`
    (`resolve_dtype`)."""
    if start_time is None:
        start_time = time.monotonic()
    np_dtype = np.dtype(np.float32) if dtype == "float32" else np.dtype(__import__("ml_dtypes").bfloat16)

    sources = param_plan(config)
    _check_plan(checkpoint, sources)
    plan = _group_layers(sources)  # one entry per output parameter: its sources, one per layer when stacked
    shapes = [_stacked_shape(group) for group in plan]
    sizes = [int(np.prod(shape)) * np_dtype.itemsize for shape in shapes]
    total_bytes, largest = sum(sizes), max(sizes)
    batch_limit = max(largest, min_batch_bytes)
    log(f"converting {config.architecture} from {source_desc}: {len(plan)} params, "
        f"{sum(int(np.prod(s)) for s in shapes) / 1e6:.1f}M values, {_fmt_bytes(total_bytes)} as {dtype} "
        f"(largest param {_fmt_bytes(largest)})")

    import orbax.checkpoint.experimental.v1 as ocp  # heavy: after the cheap checks

    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax logs every partial save at INFO/WARNING

    tmp_dir = out_dir.parent / f".{out_dir.name}.converting"
    if tmp_dir.exists():
        log(f"removing the leftover of an interrupted conversion: {str(tmp_dir)!r}")
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)
    params_dir = tmp_dir / ORBAX_PARAMS_DIR
    num_saves = 0
    try:
        context = ocp.Context()
        # The arrays are ours and never modified after being handed over: no defensive copy (it would double
        # the peak memory of every save).
        context.memory.deepcopy_host_arrays = False
        # zstd on TensorStore's threads costs ~2-3 batches of extra resident memory (measured: 117 vs 47 MiB
        # above baseline on a 204 MiB checkpoint) and saves little on weights; off unless asked for.
        context.array.saving.use_compression = compress
        with context:
            batch: list[tuple[tuple[str, ...], np.ndarray]] = []
            batch_bytes = 0
            written = 0

            def flush() -> None:
                nonlocal batch, batch_bytes, num_saves
                if batch:
                    ocp.partial.save(params_dir, _nest(batch))
                    num_saves += 1
                    batch, batch_bytes = [], 0
                    _release_free_memory()

            for i, (group, shape, size) in enumerate(zip(plan, shapes, sizes)):
                if batch_bytes + size > batch_limit:
                    flush()
                if group[0].layer is None:
                    array = read_param(checkpoint, group[0], np_dtype, chunk_bytes)
                else:  # stacked decoder-layer parameter: each layer read straight into its slice
                    array = np.empty(shape, np_dtype)
                    for source in group:
                        read_param(checkpoint, source, np_dtype, chunk_bytes, out=array[source.layer])
                batch.append((group[0].param_path, array))
                del array
                batch_bytes += size
                written += size
                names = group[0].name if len(group) == 1 else f"{group[0].name} .. {group[-1].name}"
                log(f"[{i + 1:>{len(str(len(plan)))}}/{len(plan)}] {param_path_str(group[0].param_path)} "
                    f"{shape} <- {names}  {_fmt_bytes(written)}/{_fmt_bytes(total_bytes)} "
                    f"{time.monotonic() - start_time:.1f}s")
            flush()
            log(f"finalizing the Orbax checkpoint ({num_saves} partial saves)")
            ocp.partial.finalize(params_dir)
        pytree_dir = _find_pytree_dir(params_dir)

        copied = []
        for name in COPIED_FILES:
            if (side_dir / name).is_file():
                shutil.copy2(side_dir / name, tmp_dir / name)
                copied.append(name)
        log(f"copied {', '.join(copied)}")

        marker = {
            "format": CHECKPOINT_FORMAT,
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "architecture": config.architecture,
            "dtype": dtype,
            "pytree_dir": str(pytree_dir),
            "num_params": int(sum(int(np.prod(s)) for s in shapes)),
            "num_bytes": int(total_bytes),
            "params": {param_path_str(g[0].param_path): {"shape": list(s), "dtype": dtype} for g, s in zip(plan, shapes)},
            "source": source_path,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        marker_path = tmp_dir / CHECKPOINT_MARKER
        with open(marker_path, "w") as f:
            f.write(_marker_json(marker))
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp_dir)

        # Swap into place: an existing (--force, or empty) output folder is moved aside first, then removed.
        old_dir = None
        if out_dir.exists():
            old_dir = out_dir.parent / f".{out_dir.name}.replaced-{os.getpid()}"
            os.rename(out_dir, old_dir)
        os.rename(tmp_dir, out_dir)
        _fsync_path(out_dir.parent)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise

    seconds = time.monotonic() - start_time
    log(f"wrote {str(out_dir)!r}: {_fmt_bytes(total_bytes)} in {seconds:.1f}s")
    return ConversionResult(out_dir, config, dtype, marker["num_params"], total_bytes, largest, num_saves, seconds)


__all__ = ["ConversionError", "ConversionResult", "SUPPORTED_ARCHITECTURES", "TensorSource", "convert", "read_param",
           "write_checkpoint"]
