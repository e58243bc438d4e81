"""The Hugging Face parameter mapping as data: one `ParamSource` per parameter says which HF tensor it comes
from and how to reshape it. Each model family writes its plan beside its model (`llama.hf_param_plan`,
`falcon.hf_param_plan`); `loader.hf_to_params_items` and `checkpoints_convert` execute it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# A parameter's path in the params tree, e.g. `("layers", "mlp", "up_proj", "kernel")`.
ParamPath = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """Where one parameter comes from: HF tensor `name` (expected shape `hf_shape`), its first-axis row ranges
    `rows` (all rows when None; Falcon's fused query_key_value is split this way), transposed when `transpose`
    (HF linear weights are `[out, in]`, kernels here `[in..., out...]`), then reshaped to `shape`.

    The plan is plain data so that a converter can execute it chunk by chunk (`checkpoints_convert`) instead of
    materializing the HF tensor and its transposed copy at once; `apply` is the in-memory reference.

    Decoder-layer parameters are stacked over a leading layers axis (the scanned model): their source has
    `layer = i`, and `shape` is the shape of the one-layer slice `param[i]`.
    """

    param_path: ParamPath
    name: str
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    transpose: bool = False
    rows: tuple[tuple[int, int], ...] | None = None
    layer: int | None = None

    def apply(self, tensor: np.ndarray) -> np.ndarray:
        x = tensor
        if self.rows is not None:
            parts = [x[start:stop] for start, stop in self.rows]
            x = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        if self.transpose:
            x = x.T
        return x.reshape(self.shape)

    @property
    def num_rows(self) -> int:
        """Rows of the HF tensor this parameter takes."""
        if self.rows is None:
            return self.hf_shape[0] if self.hf_shape else 1
        return sum(stop - start for start, stop in self.rows)
