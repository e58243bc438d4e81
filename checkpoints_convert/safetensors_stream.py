"""Read HF safetensors checkpoints row range by row range, with plain file reads (no memory map).

`safetensors.safe_open` memory-maps each file; pages it touches count in the process's resident set for as
long as the file stays open, so converting a whole checkpoint through it would grow RSS towards the
checkpoint size. Here every read is a `readinto` of exactly the requested rows into a fresh numpy buffer,
so resident memory is only what the caller keeps.

Every file's header is parsed and validated up front (`SafetensorsCheckpoint.__init__`): a truncated or
garbled file is reported as a `CheckpointError` naming the file, before anything is converted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from sarathi_jax.models.loader import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, CheckpointError

# safetensors dtype tags -> numpy dtypes (little-endian, as the format stores them).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# A header larger than this is certainly garbage (real headers are a few MB at most).
MAX_HEADER_BYTES = 100 << 20


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in `file`
    nbytes: int

    @property
    def row_elems(self) -> int:
        """Elements per row of the first axis (1 for a 1-D tensor)."""
        return math.prod(self.shape[1:])


def _corrupt(path: Path, detail: str) -> CheckpointError:
    return CheckpointError(f"corrupt safetensors file {str(path)!r}: {detail}")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header; `CheckpointError` naming the file if it is corrupt."""
    size = path.stat().st_size
    if size < 8:
        raise _corrupt(path, f"the file is {size} bytes, too short for the 8-byte header length")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise _corrupt(path, f"header length {header_len} does not fit in the file ({size} bytes)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_tag, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(int(d) for d in shape)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"malformed header entry for tensor {name!r}: {entry!r}") from None
        if dtype_tag not in DTYPES:
            raise _corrupt(path, f"tensor {name!r} has unknown dtype {dtype_tag!r}")
        dtype = DTYPES[dtype_tag]
        nbytes = math.prod(shape) * dtype.itemsize
        if any(d < 0 for d in shape) or begin < 0 or end - begin != nbytes:
            raise _corrupt(path, f"tensor {name!r}: shape {shape} x {dtype_tag} needs {nbytes} bytes, "
                                 f"but its data_offsets are [{begin}, {end}]")
        if end > data_size:
            raise _corrupt(path, f"tensor {name!r} ends at byte {end} of the data section, but the file holds only "
                                 f"{data_size} data bytes (truncated?)")
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, nbytes)
    return tensors


class SafetensorsCheckpoint:
    """The tensors of an HF checkpoint folder: `model.safetensors`, or the shards of `model.safetensors.index.json`."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        index_path = self.folder / SAFETENSORS_INDEX
        single_path = self.folder / SAFETENSORS_SINGLE
        self._mapped: dict[str, str] = {}  # tensor -> shard file named by the index
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"corrupt {SAFETENSORS_INDEX} in {str(self.folder)!r}: {e!r}") from None
            self._mapped = dict(weight_map)
            files = sorted(set(weight_map.values()))
        elif single_path.exists():
            files = [SAFETENSORS_SINGLE]
        else:
            raise CheckpointError(f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {str(self.folder)!r}")
        self.files = [self.folder / name for name in files]
        self.tensors: dict[str, TensorInfo] = {}
        for name, path in zip(files, self.files):
            if not path.exists():
                raise CheckpointError(f"shard {name!r} listed in the index is missing from {str(self.folder)!r}")
            for tensor_name, info in read_header(path).items():
                # With an index, a tensor belongs to the shard the index names (duplicates elsewhere are ignored).
                if not self._mapped or self._mapped.get(tensor_name) == name:
                    self.tensors[tensor_name] = info
        self.total_bytes = sum(info.nbytes for info in self.tensors.values())

    def info(self, name: str) -> TensorInfo:
        """The tensor's header entry; `CheckpointError` naming it if the checkpoint has no such tensor."""
        if name not in self.tensors:
            where = f" (the index maps it to {self._mapped[name]!r}, which does not hold it)" if name in self._mapped else ""
            raise CheckpointError(f"checkpoint is missing tensor {name!r}{where}")
        return self.tensors[name]

    def read_rows(self, info: TensorInfo, start: int, stop: int) -> np.ndarray:
        """Rows `start:stop` of the first axis as a fresh `[stop - start, row_elems]` array (1-D: elements)."""
        row_bytes = info.row_elems * info.dtype.itemsize
        out = np.empty((stop - start) * info.row_elems, info.dtype)
        view = memoryview(out.view(np.uint8))
        with open(info.file, "rb", buffering=0) as f:
            f.seek(info.offset + start * row_bytes)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise _corrupt(info.file, f"unexpected end of file while reading tensor {info.name!r}")
                done += n
        return out.reshape(stop - start, info.row_elems) if len(info.shape) > 1 else out

    def read(self, name: str) -> np.ndarray:
        """The whole tensor (for small tensors and tests)."""
        info = self.info(name)
        rows = info.shape[0] if info.shape else 1
        return self.read_rows(info, 0, rows).reshape(info.shape)

    def __getitem__(self, name: str) -> Any:  # `get_tensor` for `hf_to_params_items` (KeyError when missing)
        if name not in self.tensors:
            raise KeyError(name)
        return self.read(name)
