"""`benchmarks.probes.sampler_cost`: the table formatting, loading a baseline sampler from a file, and a tiny
end-to-end run (2 rows, vocabulary 64) that reports every case with the variant it picks."""

from __future__ import annotations

import textwrap

import pytest

from pallas_kernels.machine_rates import Bandwidth
from benchmarks.probes import sampler_cost

EXPECTED_VARIANTS = {
    "greedy": "greedy",
    "sampled": "sampled+none",
    "top-k 50": "sampled+top_k",
    "top-p 0.9 flat": "sampled+exact",
    "top-k 50 peaked": "sampled+exact",
}


def test_format_table_aligns_text_left_and_numbers_right():
    rows = [["2x64", "greedy", "1.50"], ["2x64", "top-k 50", "12.25"]]
    text = sampler_cost.format_table(["S x V", "case", "ms"], rows)
    assert text.splitlines() == [
        "S x V  case         ms",
        "-----  --------  -----",
        "2x64   greedy     1.50",
        "2x64   top-k 50  12.25",
    ]


def test_load_baseline_executes_the_file_as_a_module(tmp_path):
    path = tmp_path / "old_sampling.py"
    path.write_text(textwrap.dedent("""
        from __future__ import annotations
        import dataclasses

        @dataclasses.dataclass
        class Arrays:
            n: int

        def sample(logits, arrays):
            return logits.argmax(-1)
    """))
    module = sampler_cost.load_baseline(str(path))
    assert module.__name__ == "sampler_baseline"
    assert module.Arrays(3).n == 3  # string annotations resolve through sys.modules
    assert callable(module.sample)


def test_a_tiny_run_reports_every_case_and_its_variant(tmp_path, monkeypatch, capsys):
    # The floor uses the copy bandwidth (read + write), not the reduction's.
    monkeypatch.setattr(sampler_cost, "memory_bandwidth",
                        lambda mbytes, repeats: Bandwidth(read_bytes_per_s=3e9, copy_bytes_per_s=1e9,
                                                          array_mbytes=mbytes))
    baseline = tmp_path / "baseline.py"
    baseline.write_text("def sample(logits, arrays):\n    return logits.argmax(-1)\n")
    sampler_cost.main(["--rows", "2", "--vocab", "64", "--repeats", "1", "--baseline", str(baseline)])
    lines = capsys.readouterr().out.splitlines()
    assert "memory bandwidth (jitted copy, best): 1.0 GB/s" in lines[0]
    header, rows = lines[1], lines[3:]
    assert header.split("  ")[0] == "S x V" and header.rstrip().endswith("floor ms") and "speedup (best)" in header
    assert len(rows) == 2 * len(sampler_cost.CASES)
    seen = {}
    for row in rows:
        assert row.startswith("2x64 ")
        for case, variant in EXPECTED_VARIANTS.items():
            for label, flags in ((case, variant), (f"{case} +logprobs", f"{variant}+logprobs")):
                if f"  {label}  " in row:
                    seen[label] = flags in row.split()
        assert row.split()[-1] == f"{2 * 64 * 4 / 1e9 * 1e3:.2f}"  # the floor: logits bytes over the bandwidth
    assert len(seen) == 10 and all(seen.values()), seen


def test_bad_arguments_exit():
    with pytest.raises(SystemExit):
        sampler_cost.main(["--rows", "many"])


def test_a_tiny_head_run_reports_both_layouts_per_row_count(monkeypatch, capsys):
    monkeypatch.setattr(sampler_cost, "memory_bandwidth",
                        lambda mbytes, repeats: Bandwidth(read_bytes_per_s=3e9, copy_bytes_per_s=1e9,
                                                          array_mbytes=mbytes))
    sampler_cost.main(["--head", "16", "--head-rows", "4,8", "--vocab", "300", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[1], lines[3:]
    assert "row-major" in header and "vocab-major" in header and header.rstrip().endswith("floor ms")
    assert [row.split()[0] for row in rows] == ["4x300x16", "8x300x16"]
    for row in rows:
        assert row.split()[-1] == f"{300 * 16 * 4 / 3e9 * 1e3:.2f}"  # the head weight's bytes over the read bandwidth
        assert float(row.split()[-2]) > 0  # the speed-up column: row-major best over vocab-major best
