"""`benchmarks.probes.matmul_vs_torch`: both sides compute the same step (checked against a float64 numpy
product before anything is timed), the probe refuses to time two steps that disagree, and its table has a row per
M with both engines against the floor. A small LM head keeps it quick."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pallas_kernels.panel_matmul_cpu import pack_panels
from benchmarks.probes import matmul_vs_torch as probe


def reference_step(stack, head, x, q_width, mlp):
    x = x.astype(np.float64)
    for qkv, o, gate_up, down in stack:
        x = x + (x @ qkv.T.astype(np.float64))[:, :q_width] @ o.T.astype(np.float64)
        gu = x @ gate_up.T.astype(np.float64)
        g = gu[:, :mlp]
        x = x + (g / (1 + np.exp(-g)) * gu[:, mlp:]) @ down.T.astype(np.float64)
    return x @ head.T.astype(np.float64)


@pytest.mark.parametrize("rows", [1, 5, 70])  # the out-major product's left form, and x . W^T past its limit
@pytest.mark.parametrize("panels", [False, True])
def test_both_steps_match_a_float64_reference(rows, panels):
    stack, head, hidden, mlp = probe.random_weights("60m", vocab=96)
    q_width = stack[0][1].shape[1]
    x = np.random.default_rng(2).standard_normal((rows, hidden), dtype=np.float32)
    want = reference_step(stack, head, x, q_width, mlp)
    widths = tuple(w.shape[0] for w in stack[0])
    j_stack = [[pack_panels(w) if panels else w for w in layer] for layer in stack]
    got_jax = np.asarray(probe.jax_step(q_width, mlp, widths, panels)(x, j_stack, head))
    got_torch = probe.torch_step(stack, head, q_width, mlp)(torch.from_numpy(x)).numpy()
    for got in (got_jax, got_torch):
        assert got.shape == (rows, 96)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_prints_a_row_per_m(capsys):
    assert probe.main(["--rows", "1,3", "--repeats", "1", "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "torch / jax" in out and "8 layers + an LM head of 64" in out
    lines = [line for line in out.splitlines() if line.startswith("M=")]
    assert [line.split()[0] for line in lines] == ["M=1", "M=3"]


def test_refuses_to_time_steps_that_disagree(monkeypatch):
    real = probe.torch_step
    monkeypatch.setattr(probe, "torch_step", lambda *a: (lambda x, step=real(*a): step(x) * 1.5))
    with pytest.raises(SystemExit, match="disagree"):
        probe.main(["--rows", "2", "--repeats", "1", "--vocab", "64"])


def test_bad_arguments_exit():
    with pytest.raises(SystemExit):
        probe.main(["--rows", "0"])
