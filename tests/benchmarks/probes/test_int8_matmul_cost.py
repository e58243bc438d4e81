"""`benchmarks.probes.int8_matmul_cost`: its forms compute the same product, and the table comes out."""

from __future__ import annotations

import numpy as np

from benchmarks.probes import int8_matmul_cost
from pallas_kernels.panel_matmul_cpu import panel_matmul_int8_reference


def test_quantize_per_output_column():
    w = np.array([[127, 2.5, 3.5, -2.5], [0, 0, 0, 0], [-6, 3, 1, 0]], np.float32) / 64  # exact in float32
    q, scale = int8_matmul_cost.quantize(w)
    np.testing.assert_allclose(scale, [1 / 64, 0.0, 6 / 64 / 127], rtol=1e-6)
    assert q.dtype == np.int8 and q[:2].tolist() == [[127, 2, 4, -2], [0, 0, 0, 0]]  # halves to even
    assert q[2].tolist() == [-127, 64, 21, 0]  # 63.5 and 21.17


def test_the_forms_agree():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((70, 40), np.float32)
    x = rng.standard_normal((5, 40), np.float32)
    q, scale = int8_matmul_cost.quantize(w)
    forms, weights = int8_matmul_cost.forms(), int8_matmul_cost.weights(w)
    for name in ("int8", "xla deq"):
        np.testing.assert_allclose(forms[name](x, *weights[name]), panel_matmul_int8_reference(x, q, scale),
                                   rtol=1e-5, atol=1e-4, err_msg=name)
    for name in ("f32", "xla f32"):
        np.testing.assert_allclose(forms[name](x, *weights[name]), x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4,
                                   err_msg=name)


def test_int8_matmul_cost_end_to_end(monkeypatch, capsys):
    monkeypatch.setitem(int8_matmul_cost.SHAPES, "tiny", {"qkv": (32, 96), "down": (48, 32)})
    monkeypatch.setattr(int8_matmul_cost, "memory_bandwidth", lambda mbytes, repeats: _Bandwidth())
    int8_matmul_cost.main(["--models", "tiny", "--rows", "1,7", "--repeats", "1", "--cold-mbytes", "0.05"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:9] == ["case", "int8", "ms", "f32", "ms", "xla", "f32", "ms", "xla"]
    assert [line.split()[:3] for line in lines[3:]] == [["tiny", "qkv", "1x32x96"], ["tiny", "qkv", "7x32x96"],
                                                       ["tiny", "down", "1x48x32"], ["tiny", "down", "7x48x32"]]


class _Bandwidth:
    read_bytes_per_s = 1e10
