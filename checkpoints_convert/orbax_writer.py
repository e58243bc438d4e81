"""The one Orbax writer behind every input format (see converter.py's module doc for the layout, the memory
bound and the atomic rename): planned parameters -> batches of `partial.save`, side files, the completion
marker, then the rename into place."""

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
from typing import Any, Callable

import numpy as np

from checkpoints_convert.param_reader import CHUNK_BYTES, TensorSource, check_plan, group_layers, read_param, stacked_shape
from sarathi_jax.models.config import ModelConfig
from sarathi_jax.models.families import param_plan
from sarathi_jax.models.loader import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_FORMAT_VERSION,
    CHECKPOINT_MARKER,
    ORBAX_PARAMS_DIR,
    CheckpointError,
    param_path_str,
)

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
MIN_BATCH_BYTES = 32 << 20

Log = Callable[[str], None]


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


def release_free_memory() -> None:
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
    rename into place. The caller has checked the output folder (`converter.prepare_out`) and resolved `dtype`
    (`converter.resolve_dtype`)."""
    if start_time is None:
        start_time = time.monotonic()
    np_dtype = np.dtype(np.float32) if dtype == "float32" else np.dtype(__import__("ml_dtypes").bfloat16)

    sources = param_plan(config)
    check_plan(checkpoint, sources)
    plan = group_layers(sources)  # one entry per output parameter: its sources, one per layer when stacked
    shapes = [stacked_shape(group) for group in plan]
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
                    release_free_memory()

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
