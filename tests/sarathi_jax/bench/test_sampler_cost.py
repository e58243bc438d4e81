"""`sarathi_jax.bench.sampler_cost`: the table formatting, loading a baseline sampler from a file, the bandwidth
floor, and a tiny end-to-end run (2 rows, vocabulary 64) that reports every case with the variant it picks."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from sarathi_jax.bench import sampler_cost

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


def test_memory_bandwidth_is_the_bytes_copied_over_the_best_run(monkeypatch):
    """The timer is replaced by one that runs the call and returns set times: the figure must be read + write
    bytes over the fastest run, and the timed call must copy the whole array."""
    times = iter([3e-3, 1e-3, 2e-3])
    timed = []

    def fake_seconds_per_call(fn, *args, iters=1):
        timed.append((args, np.asarray(fn(*args))))
        return next(times)

    monkeypatch.setattr(sampler_cost, "seconds_per_call", fake_seconds_per_call)
    nbytes = 1 << 16
    assert sampler_cost.memory_bandwidth(repeats=3, nbytes=nbytes) == 2 * nbytes / 1e-3
    assert len(timed) == 3
    (x,), out = timed[0]
    assert x.nbytes == nbytes and out.shape == x.shape
    np.testing.assert_array_equal(out, np.asarray(x) + 1.0)  # every element read and written


def test_a_tiny_run_reports_every_case_and_its_variant(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sampler_cost, "memory_bandwidth", lambda repeats: 1e9)
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
