"""`python -m benchmarks.kernels`, run small: the Pallas kernel against XLA, and on a CPU the C++ kernel against
its floors and, with `--baseline-library`, against another build of itself in alternating rounds."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import kernels as bench
from pallas_kernels import cases as bench_cases


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




def test_bench_runs(capsys, tmp_path):
    out_file = tmp_path / "bench.json"
    bench.main([
        "--decodes", "3", "--decode-ctx", "40", "--prefill-chunks", "17,5", "--prefill-ctx", "0,30",
        "--num-q-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "float32",
        "--iters", "1", "--matmul-n", "64", "--copy-mib", "1", "--shuffle-seqs", "--num-kv-splits", "2",
        "--out", str(out_file), "--kernel", "pallas",
    ])
    out = capsys.readouterr().out
    assert "pallas vs xla" in out and "(OK" in out and "floor" in out
    assert "FlashAttention comparison:" in out and "config: rules decode; rules prefill + explicit num_kv_splits" in out
    result = json.loads(out_file.read_text())
    (case,) = result["cases"]
    assert case["ok"] and case["config"]["max_splits"] == 2 and case["floor_us"] > 0 and case["pallas_us"] > 0


def test_bench_cpu_suite_times_the_cpu_kernel_beside_the_jnp_path(capsys, tmp_path):
    out_file = tmp_path / "bench.json"
    bench.main(["--cpu-heads", "4,2,64;4,1,128", "--cases", "1,10", "--iters", "1", "--repeats", "1",
                "--matmul-n", "64", "--copy-mib", "1", "--out", str(out_file)])
    out = capsys.readouterr().out
    assert "| 4/2/64 (2) | 1 decode x ctx 512 |" in out and "| 4/1/128 (4) | 16-token chunk at ctx 512" in out
    cases = json.loads(out_file.read_text())["cases"]
    assert len(cases) == 4 and all(c["ok"] and c["cpu_us"] > 0 and c["xla_us"] > 0 for c in cases)
    assert all(c["max_rel_diff_vs_xla"] <= 1e-5 and c["floor_us"] > 0 for c in cases)
    heads = {(c["group"], c["case"]) for c in cases}
    assert heads == {(2, "1 decode x ctx 512"), (2, "16-token chunk at ctx 512 (short prefill)"),
                     (4, "1 decode x ctx 512"), (4, "16-token chunk at ctx 512 (short prefill)")}
    groups = {hq // hkv for hq, hkv, _ in bench_cases.CPU_HEADS}
    assert groups == {1, 4, 8} and {d for *_, d in bench_cases.CPU_HEADS} == {64, 128}


def test_bench_suite_has_the_gpu_rows():
    rows = {(c.decodes, c.decode_ctx, c.chunks, c.chunk_ctx) for c in bench_cases.SUITE}
    assert rows == {
        (64, 1024, (), ()), (256, 2048, (), ()), (8, 16384, (), ()), (32, 1024, (512,), (1536,)),
        (0, 0, (2048,), (0,)), (0, 0, (512,), (1536,)),
    }
