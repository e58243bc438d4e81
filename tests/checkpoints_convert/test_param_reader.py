"""`param_reader`: one planned parameter read out of a safetensors folder chunk by chunk (`read_param`) equals
the plan's in-memory reference (`ParamSource.apply`) on the whole tensor, for every chunk size, with row
ranges, transposes and layer slices; and the plan grouping the writer relies on."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoints_convert.param_reader import check_plan, group_layers, read_param, stacked_shape
from checkpoints_convert.safetensors_stream import SafetensorsCheckpoint
from sarathi_jax.models.loader import CheckpointError
from sarathi_jax.models.param_source import ParamSource


@pytest.fixture()
def checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "fused.weight": rng.standard_normal((12, 5)).astype(np.float32),
        "norm.weight": rng.standard_normal(5).astype(np.float32),
        "layers.0.w": rng.standard_normal((4, 3)).astype(np.float32),
        "layers.1.w": rng.standard_normal((4, 3)).astype(np.float32),
        "ids": np.arange(6, dtype=np.int32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return SafetensorsCheckpoint(tmp_path), tensors


def test_safetensors_rows_match_the_file(checkpoint):
    ckpt, tensors = checkpoint
    info = ckpt.info("fused.weight")
    assert info.shape == (12, 5) and info.row_elems == 5
    np.testing.assert_array_equal(ckpt.read_rows(info, 3, 7), tensors["fused.weight"][3:7])
    np.testing.assert_array_equal(ckpt.read("norm.weight"), tensors["norm.weight"])


@pytest.mark.parametrize("chunk_bytes", [1, 20, 64, 1 << 20])  # 1 byte: one row per chunk
@pytest.mark.parametrize("transpose", [False, True])
def test_read_param_equals_apply_on_the_whole_tensor(checkpoint, chunk_bytes, transpose):
    ckpt, tensors = checkpoint
    rows = ((0, 4), (8, 12))  # a fused tensor split by row ranges, as Falcon's query_key_value
    shape = (5, 8) if transpose else (8, 5)
    source = ParamSource(("p", "kernel"), "fused.weight", (12, 5), shape, transpose=transpose, rows=rows)
    got = read_param(ckpt, source, np.dtype(np.float32), chunk_bytes)
    assert got.shape == shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, source.apply(tensors["fused.weight"]))


def test_read_param_into_a_layer_slice_and_the_plan_grouping(checkpoint):
    ckpt, tensors = checkpoint
    plan = [
        ParamSource(("norm", "scale"), "norm.weight", (5,), (5,)),
        ParamSource(("layers", "w"), "layers.0.w", (4, 3), (3, 4), transpose=True, layer=0),
        ParamSource(("layers", "w"), "layers.1.w", (4, 3), (3, 4), transpose=True, layer=1),
    ]
    check_plan(ckpt, plan)
    groups = group_layers(plan)
    assert [len(g) for g in groups] == [1, 2]
    assert [stacked_shape(g) for g in groups] == [(5,), (2, 3, 4)]
    stacked = np.empty(stacked_shape(groups[1]), np.float32)
    for source in groups[1]:
        read_param(ckpt, source, np.dtype(np.float32), 16, out=stacked[source.layer])
    np.testing.assert_array_equal(stacked, np.stack([tensors["layers.0.w"].T, tensors["layers.1.w"].T]))


def test_read_param_refuses_bad_shapes_and_dtypes(checkpoint):
    ckpt, _ = checkpoint
    with pytest.raises(CheckpointError, match="has shape"):
        check_plan(ckpt, [ParamSource(("p",), "norm.weight", (6,), (6,))])
    with pytest.raises(CheckpointError, match="non-float dtype"):
        read_param(ckpt, ParamSource(("p",), "ids", (6,), (6,)), np.dtype(np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        read_param(ckpt, ParamSource(("p",), "norm.weight", (5,), (5,)), np.dtype(np.float32),
                   out=np.empty(5, np.float64))
    with pytest.raises(AssertionError, match="not 0..n-1"):
        group_layers([ParamSource(("l",), "layers.1.w", (4, 3), (4, 3), layer=1)])
