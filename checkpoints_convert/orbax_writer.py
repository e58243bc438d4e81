"""The one Orbax writer behind every input format (see converter.py's module doc for the layout, the memory
bound and the atomic rename): planned parameters -> batches of `partial.save`, side files, the completion
marker, then the rename into place.

With `config.quantization` ("int8") every decoder-layer projection kernel is read as float32, one layer at a
time, and quantized on the host (`loader.quantized_in_axes` + `quantization.quantize_kernel`, exactly what
`load_hf_params` does at load): its `kernel` leaf is written int8 and a float32 `kernel_scale` leaf beside it;
every other parameter is written in `dtype`. The marker records the quantization and each leaf's real dtype."""

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

import jax
import numpy as np

from checkpoints_convert.param_reader import CHUNK_BYTES, TensorSource, check_plan, group_layers, read_param, stacked_shape
from sarathi_jax.models.config import ModelConfig
from sarathi_jax.models.families import checkpoint_param_shapes, param_plan
from sarathi_jax.models.loader import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_FORMAT_VERSION,
    CHECKPOINT_MARKER,
    ORBAX_PARAMS_DIR,
    CheckpointError,
    param_path_str,
    quantized_in_axes,
)
from sarathi_jax.models.quantization import KERNEL_SCALE, quantize_kernel

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
    config: ModelConfig  # `config.quantization`: the projections' storage ("int8"), or None (all in `dtype`)
    dtype: str
    num_params: int  # parameter count (elements; the scales of quantized kernels not counted)
    num_bytes: int  # bytes written (every leaf in its stored dtype, scales included)
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


def _scale_path(kernel_path: tuple[str, ...]) -> tuple[str, ...]:
    return kernel_path[:-1] + (KERNEL_SCALE,)


def _dtype_name(dtype: Any) -> str:
    """"float32", "bfloat16", "int8" (the marker's spelling, `--dtype`'s for the float ones)."""
    return np.dtype(dtype).name


def _read_quantized(checkpoint: TensorSource, group: list[Any], group_leaves: list[tuple[tuple[str, ...], Any]],
                    in_axes: tuple[int, ...], quantization: str,
                    chunk_bytes: int) -> list[tuple[tuple[str, ...], np.ndarray]]:
    """A projection kernel's `(path, q), (scale path, scale)`: each layer (or the whole parameter, unstacked)
    read as float32 into one scratch array and quantized (`quantize_kernel`, as `load_hf_params` does), so
    besides the 8-bit result only one layer's float32 values and their temporaries are held."""
    (kernel_path, kernel_leaf), (scale_path, scale_leaf) = group_leaves
    if group[0].layer is None:
        q, scale = quantize_kernel(read_param(checkpoint, group[0], np.dtype(np.float32), chunk_bytes), in_axes,
                                   quantization)
    else:
        q = np.empty(kernel_leaf.shape, kernel_leaf.dtype)
        scale = np.empty(scale_leaf.shape, scale_leaf.dtype)
        scratch = np.empty(group[0].shape, np.float32)
        for source in group:
            read_param(checkpoint, source, np.dtype(np.float32), chunk_bytes, out=scratch)
            q[source.layer], scale[source.layer] = quantize_kernel(scratch, in_axes, quantization)
        del scratch
    if q.dtype != kernel_leaf.dtype or q.shape != tuple(kernel_leaf.shape) or scale.shape != tuple(scale_leaf.shape):
        raise AssertionError(f"{param_path_str(kernel_path)}: quantized to {q.shape} {q.dtype} + {scale.shape}, "
                             f"the model stores {kernel_leaf.shape} {kernel_leaf.dtype} + {scale_leaf.shape}")
    return [(kernel_path, q), (scale_path, np.asarray(scale, np.float32))]


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
    (`converter.resolve_dtype`). With `config.quantization` the decoder layers' projection kernels are written
    quantized (module doc)."""
    if start_time is None:
        start_time = time.monotonic()
    np_dtype = np.dtype(np.float32) if dtype == "float32" else np.dtype(__import__("ml_dtypes").bfloat16)

    sources = param_plan(config)
    check_plan(checkpoint, sources)
    plan = group_layers(sources)  # one entry per output parameter: its sources, one per layer when stacked
    shapes = [stacked_shape(group) for group in plan]
    in_axes_of = quantized_in_axes(config)
    quantized = [in_axes_of(group[0]) for group in plan]  # each parameter's in_axes when quantized, else None
    # Every stored leaf (a quantized kernel is two: q and its scales), with its shape and stored dtype.
    leaf_of = {tuple(k.key for k in p): x for p, x in
               jax.tree_util.tree_leaves_with_path(checkpoint_param_shapes(config, np_dtype))}
    paths = [[g[0].param_path] + ([] if a is None else [_scale_path(g[0].param_path)]) for g, a in zip(plan, quantized)]
    leaves = [[(path, leaf_of[path]) for path in group_paths] for group_paths in paths]
    for group, shape, group_leaves in zip(plan, shapes, leaves):
        if tuple(group_leaves[0][1].shape) != shape:
            raise AssertionError(f"{param_path_str(group[0].param_path)}: plan {shape}, model "
                                 f"{group_leaves[0][1].shape}")
    sizes = [sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for _, leaf in ls) for ls in leaves]
    total_bytes, largest = sum(sizes), max(sizes)
    batch_limit = max(largest, min_batch_bytes)
    storage = dtype if config.quantization is None else f"{dtype}, projections {config.quantization} + float32 scales"
    log(f"converting {config.architecture} from {source_desc}: {len(plan)} params, "
        f"{sum(int(np.prod(s)) for s in shapes) / 1e6:.1f}M values, {_fmt_bytes(total_bytes)} as {storage} "
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

            for i, (group, shape, size, in_axes, group_leaves) in enumerate(
                    zip(plan, shapes, sizes, quantized, leaves)):
                if batch_bytes + size > batch_limit:
                    flush()
                if in_axes is not None:
                    batch.extend(_read_quantized(checkpoint, group, group_leaves, in_axes, config.quantization,
                                                 chunk_bytes))
                elif group[0].layer is None:
                    batch.append((group[0].param_path, read_param(checkpoint, group[0], np_dtype, chunk_bytes)))
                else:  # stacked decoder-layer parameter: each layer read straight into its slice
                    array = np.empty(shape, np_dtype)
                    for source in group:
                        read_param(checkpoint, source, np_dtype, chunk_bytes, out=array[source.layer])
                    batch.append((group[0].param_path, array))
                    del array
                batch_bytes += size
                written += size
                names = group[0].name if len(group) == 1 else f"{group[0].name} .. {group[-1].name}"
                stored = "" if in_axes is None else f" {config.quantization}"
                log(f"[{i + 1:>{len(str(len(plan)))}}/{len(plan)}] {param_path_str(group[0].param_path)} "
                    f"{shape}{stored} <- {names}  {_fmt_bytes(written)}/{_fmt_bytes(total_bytes)} "
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
            "dtype": dtype,  # every parameter's but the quantized kernels' and their scales'
            "quantization": config.quantization,
            "pytree_dir": str(pytree_dir),
            "num_params": int(sum(int(np.prod(s)) for s in shapes)),
            "num_bytes": int(total_bytes),
            "params": {param_path_str(path): {"shape": list(leaf.shape), "dtype": _dtype_name(leaf.dtype)}
                       for group_leaves in leaves for path, leaf in group_leaves},
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
