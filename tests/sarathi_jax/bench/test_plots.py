"""`sarathi_jax/bench/plots.py` directly: the step outline of the timeline and a capacity bar chart as a PNG."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from sarathi_jax.bench.plots import _step_xy, plot_capacity


def test_step_outline_is_flat_over_each_iteration_and_zero_between() -> None:
    x, y = _step_xy(np.array([0.0, 2.0]), np.array([1.0, 0.5]), np.array([3.0, 4.0]))
    assert x.tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 2.5, 2.5]
    assert y.tolist() == [0.0, 3.0, 3.0, 0.0, 0.0, 4.0, 4.0, 0.0]


def test_capacity_plot_writes_a_png(tmp_path) -> None:
    result = SimpleNamespace(capacity_qps=1.5, slo_tbt=0.0618, max_sched_delay=2.0)
    path = plot_capacity({"sarathi-512": result, "vllm": SimpleNamespace(**{**vars(result), "capacity_qps": 1.0})},
                         str(tmp_path / "capacity.png"))
    data = (tmp_path / "capacity.png").read_bytes()
    assert path == str(tmp_path / "capacity.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
