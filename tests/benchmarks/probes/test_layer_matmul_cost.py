"""`benchmarks.probes.layer_matmul_cost` and `out_major_steps`: the forms the first times compute the same
product (else its table compares different work), a tiny end-to-end run of each."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.panel_matmul_cpu import pack_panels
from benchmarks.probes import layer_matmul_cost, out_major_steps


def test_every_form_computes_the_same_matmul_and_layer_stack():
    rng = np.random.default_rng(0)
    shapes = layer_matmul_cost.projection_shapes(32, 48, 4, 2, 8)
    assert shapes == {"qkv": (32, 64), "o": (32, 32), "gate_up": (32, 96), "down": (48, 32)}
    x = rng.standard_normal((3, 32), dtype=np.float32)
    w = rng.standard_normal((32, 64), dtype=np.float32)
    forms = layer_matmul_cost.matmul_formulations()
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(forms["row"](x, w), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(forms["left+T"](x, np.ascontiguousarray(w.T)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(forms["feature"](np.ascontiguousarray(x.T), np.ascontiguousarray(w.T)), want.T,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(forms["kernel"](x, pack_panels(np.ascontiguousarray(w.T)), 64), want, rtol=1e-5,
                               atol=1e-5)
    ws = tuple(jnp.asarray(rng.standard_normal((2, k, n), dtype=np.float32) * 0.1) for k, n in shapes.values())
    ws_t = tuple(jnp.swapaxes(a, 1, 2) for a in ws)
    ws_p = tuple(pack_panels(a) for a in ws_t)
    ref = layer_matmul_cost.layer_stack("row", shapes, 48, scan=True)(x, ws)
    per_layer = [tuple(tuple(w[i] for w in stacked) for i in range(2)) for stacked in (ws, ws_t, ws_p)]
    np.testing.assert_allclose(layer_matmul_cost.layer_stack("row", shapes, 48, scan=False)(x, per_layer[0]), ref,
                               rtol=1e-4, atol=1e-5)
    for form in ("left+T", "feature", "kernel"):
        stacked, unrolled = (ws_p, per_layer[2]) if form == "kernel" else (ws_t, per_layer[1])
        for scan, weights in ((True, stacked), (False, unrolled)):
            np.testing.assert_allclose(layer_matmul_cost.layer_stack(form, shapes, 48, scan)(x, weights), ref,
                                       rtol=1e-4, atol=1e-5, err_msg=f"{form} scan={scan}")


def test_layer_matmul_cost_end_to_end(monkeypatch, capsys):
    monkeypatch.setitem(layer_matmul_cost.MODELS, "tiny", (32, 48, 4, 2, 8, 2))
    monkeypatch.setattr(layer_matmul_cost, "memory_bandwidth", lambda mbytes, repeats: _Bandwidth())
    for flags, title in (([], "unrolled over per-layer"), (["--scan"], "scan over stacked")):
        layer_matmul_cost.main(["--models", "tiny", "--rows", "1,2", "--repeats", "1", *flags])
        out = capsys.readouterr().out
        assert "one matmul, tiny:" in out and f"layer stack ({title} weights), tiny:" in out
        assert "kernel median / best ms" in out  # the kernel is built (its own tests fail where it is not)
        assert sum(line.startswith("tiny qkv ") for line in out.splitlines()) == 2
        assert sum(line.startswith("tiny 2 layers, M=") for line in out.splitlines()) == 2


class _Bandwidth:
    read_bytes_per_s = 1e10


def test_out_major_steps_end_to_end(capsys):
    out_major_steps.main(["--model", "tiny-llama", "--mode", "decode", "--batch-sizes", "1,2", "--context", "8",
                          "--token-budget", "16", "--max-num-seqs", "4", "--max-model-len", "64", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["composition", "in-major", "out-major", "median", "ratio"]
    assert [line.split()[:2] for line in lines[2:]] == [["decode", "x1"], ["decode", "x2"]]


def test_out_major_steps_compares_out_major_with_panels(capsys):
    out_major_steps.main(["--compare", "panels", "--model", "tiny-llama", "--dtype", "float32", "--mode", "decode",
                          "--batch-sizes", "1", "--context", "8", "--token-budget", "16", "--max-num-seqs", "4",
                          "--max-model-len", "64", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["composition", "out-major", "panels", "median", "ratio"]
    assert [line.split()[:2] for line in lines[2:]] == [["decode", "x1"]]


def test_out_major_steps_compares_scanned_with_unrolled_layers(capsys):
    out_major_steps.main(["--compare", "scan-layers", "--model", "tiny-llama", "--mode", "decode", "--batch-sizes",
                          "1", "--context", "8", "--token-budget", "16", "--max-num-seqs", "4", "--max-model-len",
                          "64", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["composition", "scanned", "unrolled", "median", "ratio"]
    assert [line.split()[:2] for line in lines[2:]] == [["decode", "x1"]]
    with pytest.raises(SystemExit, match="--compare must be one of"):
        out_major_steps.main(["--compare", "fast", "--model", "tiny-llama"])
