"""`python -m pallas_kernels.bench` on a CPU (pallas_kernels/bench_cpu.py), run small: the C++ kernel against
its floors and, with `--baseline-library`, against another build of itself in alternating rounds."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pallas_kernels import bench


def test_cpu_suite_with_a_baseline_build(tmp_path):
    # The baseline is this very build, loaded a second time under its own FFI target: same outputs.
    library = importlib.util.find_spec("pallas_kernels._cpu_attention").origin
    out = tmp_path / "cpu.json"
    bench.main(["--kernel", "cpu", "--cpu-only", "--cases", "10,11", "--cpu-heads", "4,2,32", "--iters", "1",
                "--repeats", "2", "--matmul-n", "256", "--copy-mib", "16", "--baseline-library", library,
                "--out", str(out)])
    records = json.loads(out.read_text())["cases"]
    assert [r["case"] for r in records] == ["16-token chunk at ctx 512 (short prefill)", "prefill 512 tokens"]
    for r in records:
        assert r["ok"] and r["max_rel_diff_vs_baseline"] == 0.0, r
        assert r["cpu_us"] > 0 and r["baseline_us"] > 0
        assert r["baseline_ratio"] == r["cpu_us"] / r["baseline_us"]
        # seconds / seconds there, microseconds / microseconds here: equal to rounding, not always bitwise
        assert r["floor_us"] > 0 and r["cpu_over_floor"] == pytest.approx(r["cpu_us"] / r["floor_us"], rel=1e-12)
