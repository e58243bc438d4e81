"""Peak host memory of converting a ~232 MiB checkpoint stays near one (stacked) parameter, not the checkpoint.

`python -m checkpoints_convert.peak_memory` runs in a subprocess: it imports JAX/Orbax/the converter, takes its
resident high-water mark as the baseline, converts, and reports `peak - baseline`. The checkpoint (random
float32 Llama, 8 layers of hidden 1024 / MLP 1024, eight shards) is written by a separate process with
safetensors directly. The converted layers are stacked (the scanned model), so the largest parameter is one
matrix of all 8 layers: 32 MiB. The same checkpoint converted with `--quantization int8` stays under the same
bound.

Bound: 1.5 x the largest parameter (32 MiB here) + a fixed allowance of 64 MiB. The allowance covers the
converter's minimum batch (32 MiB of small parameters per Orbax partial save), its 8 MiB read chunk, and
Orbax/TensorStore's own working set on the first save (~10 MiB measured). Holding the checkpoint (232 MiB)
would fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from sarathi_jax.models import load_model

ALLOWANCE_MIB = 64
REPO = Path(__file__).resolve().parents[2]


def peak_memory(hf: Path, out: Path, *options: str) -> dict:
    """`checkpoints_convert.peak_memory --synthetic --dtype float32 *options`'s JSON line."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, "-m", "checkpoints_convert.peak_memory", "--hf", str(hf), "--out", str(out),
               "--synthetic", "--dtype", "float32", *options]
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    print("peak memory:", stats)
    return stats


def test_peak_memory_of_a_200mb_conversion(tmp_path):
    hf, out = tmp_path / "hf", tmp_path / "out"
    stats = peak_memory(hf, out)
    assert stats["total_mib"] > 200 and stats["largest_param_mib"] == 32.0
    limit = 1.5 * stats["largest_param_mib"] + ALLOWANCE_MIB
    assert limit < stats["total_mib"] / 2  # the bound really rules out holding the checkpoint
    assert stats["delta_mib"] < limit, stats

    # The streamed output is right: spot-check a transposed MLP kernel against the source tensor.
    from safetensors import safe_open

    _, params = load_model(out, jnp.float32)
    with safe_open(hf / "model-00002-of-00008.safetensors", framework="numpy") as f:
        source = f.get_tensor("model.layers.1.mlp.down_proj.weight")
    np.testing.assert_array_equal(np.asarray(params["layers"]["mlp"]["down_proj"]["kernel"][1]), source.T)


def test_peak_memory_of_an_int8_conversion(tmp_path):
    """`--quantization int8` reads each projection one layer at a time as float32 and quantizes it: the peak stays
    under the float32 conversion's bound (its largest parameter is 32 MiB in float32, 8 MiB as int8)."""
    stats = peak_memory(tmp_path / "hf", tmp_path / "out", "--quantization", "int8")
    assert stats["quantization"] == "int8" and stats["largest_param_mib"] == 8.0 and stats["total_mib"] < 70
    assert stats["delta_mib"] < 1.5 * 32 + ALLOWANCE_MIB, stats
