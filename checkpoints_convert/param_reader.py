"""Reading one planned parameter out of a tensor source, chunk by chunk, straight into its target dtype.

The plan (`sarathi_jax.models.param_plan`) names, per parameter (per layer for the stacked decoder layers),
the HF tensor, the rows it takes and whether it is transposed. A `TensorSource` is anything with
`SafetensorsCheckpoint`'s `info(name)` / `read_rows(info, r0, r1)` (a safetensors folder, a GGUF file).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from sarathi_jax.models.loader import CheckpointError, param_path_str
from sarathi_jax.models.param_source import ParamSource

CHUNK_BYTES = 8 << 20


class TensorSource(Protocol):
    """What the writer reads tensors through: `SafetensorsCheckpoint`, or `gguf_source.GGUFCheckpoint`.
    `info(name)` has `.shape`, `.dtype`, `.row_elems`; `read_rows(info, r0, r1)` returns rows r0..r1."""

    def info(self, name: str) -> Any: ...

    def read_rows(self, info: Any, start: int, stop: int) -> np.ndarray: ...


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


def check_plan(checkpoint: TensorSource, plan: list[ParamSource]) -> None:
    """Every tensor the model needs exists with the right shape: checked from the headers before writing."""
    for source in plan:
        info = checkpoint.info(source.name)
        if info.shape != source.hf_shape:
            raise CheckpointError(
                f"tensor {source.name!r} has shape {info.shape}, expected {source.hf_shape} for this config"
            )


def group_layers(plan: list[ParamSource]) -> list[list[ParamSource]]:
    """The plan's sources grouped by output parameter, in first-appearance order; a stacked parameter's
    group holds its layers in order."""
    groups: dict[tuple[str, ...], list[ParamSource]] = {}
    for source in plan:
        groups.setdefault(source.param_path, []).append(source)
    for group in groups.values():
        if group[0].layer is not None and [s.layer for s in group] != list(range(len(group))):
            raise AssertionError(f"layers of {param_path_str(group[0].param_path)} are not 0..n-1 in order")
    return list(groups.values())


def stacked_shape(group: list[ParamSource]) -> tuple[int, ...]:
    return group[0].shape if group[0].layer is None else (len(group), *group[0].shape)
