"""`python -m benchmarks.gpu_report --smoke`: the whole report, every part in its own process, for real, on
the CPU (tiny-llama, the Pallas kernel in interpret mode; about 1.5 minutes on 2 cores)."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_report import run as report_run
from test_gpu_report import check_figures

TIMED_PARTS = ("attention", "profile_large", "profile_small", "loop")  # their times have floors


def test_smoke_report_has_every_part_with_figures_against_floors(tmp_path):
    out = tmp_path / "report"
    assert report_run.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads((out / "report.json").read_text())
    assert doc["finished"] and doc["smoke"] and list(doc["parts"]) == list(report_run.PART_NAMES)
    for name, part in doc["parts"].items():
        assert part["status"] == "ok", (name, part["error"])
        assert part["seconds"] > 0 and part["error"] is None and (out / part["log"]).exists()
        check_figures(part["result"]["figures"])
    parts = doc["parts"]
    rates = parts["machine"]["result"]["rates"]
    assert rates["matmul_flops_per_s"] > 0 and rates["bandwidth_bytes_per_s"] > 0
    assert parts["machine"]["result"]["info"]["versions"]["jax"]
    for name in TIMED_PARTS:  # every time there stands beside its floor; the later parts used the machine's rates
        times = [f for f in parts[name]["result"]["figures"] if f["unit"] == "s"]
        assert times and all(f["floor"] for f in times), name
        assert parts[name]["result"]["info"]["rates_from"] == "machine part"
    for name in ("startup_small", "startup_large"):
        runs = parts[name]["result"]["runs"]
        assert len(runs) == 2 and runs[0]["cache_hits"] == 0 < runs[1]["cache_hits"]
        assert all(f["floor"] is None for f in parts[name]["result"]["figures"])

    # The tuning table lands in DIR and the parts after `tune` ran with it.
    table = json.loads((out / "tuning_table.json").read_text())
    entries = parts["tune"]["result"]["info"]["entries"]
    assert entries == len(table["entries"]) == len(parts["tune"]["result"]["tables"][0]["rows"])
    assert len([f for f in parts["tune"]["result"]["figures"] if f["floor"]]) == entries  # each measured entry
    assert parts["tune"]["result"]["info"]["rates_from"] == "machine part"
    assert doc["tuning_table_used"] == str(out / "tuning_table.json")
    assert parts["attention"]["result"]["info"]["tuning_table"] == str(out / "tuning_table.json")
    attention = parts["attention"]["result"]
    assert len(attention["cases"]) == 2 and all(c["ok"] for c in attention["cases"])
    assert "CUDA" in attention["info"]["flash_attention"]  # torch here has no CUDA: said, not fatal
    # Each case's floor is the larger of its FLOPs over the machine part's matmul rate and its bytes over its
    # bandwidth, named by kind (which kind a case gets depends on the rates measured, so it is not fixed here).
    for case in attention["cases"]:
        compute_us = case["gflop"] * 1e9 / rates["matmul_flops_per_s"] * 1e6
        memory_us = case["min_mb"] * 1e6 / rates["bandwidth_bytes_per_s"] * 1e6
        assert case["floor_us"] == pytest.approx(max(compute_us, memory_us), rel=1e-9)
        assert case["floor_kind"] == ("memory" if memory_us >= compute_us else "compute")

    sections = parts["profile_large"]["result"]["sections"]
    decode, mixed = sections.values()
    assert decode["decodes_per_step"] == 4 and decode["compilations_during_trace"] == 0
    assert mixed["tokens_per_step"] == 32 and mixed["decodes_per_step"] == 4  # decodes + a chunk fill the budget
    assert all((out / s["trace"]).exists() for s in sections.values())
    loop = parts["loop"]["result"]["rows"]
    assert sorted({(r["batch"], r["loop"]) for r in loop}) == [(b, x) for b in (1, 2, 4) for x in ("async", "sync")]

    md = (out / "report.md").read_text()
    assert md.startswith("# GPU report") and "**Smoke run**" in md
    assert all(f"## {name}: " in md for name in report_run.PART_NAMES)
