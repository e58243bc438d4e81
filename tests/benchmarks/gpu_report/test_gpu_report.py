"""`benchmarks.gpu_report`: a part that hangs (killed at its timeout) and one that fails beside a part that
still runs, the deadline, and the pure pieces (a traced section's figures, the scaled attention mixes, the
Markdown). The whole `--smoke` report is in test_gpu_report_smoke.py (a file of its own: a worker of its own)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu_report import md as report_md
from benchmarks.gpu_report import parts as report_parts
from benchmarks.gpu_report import profiles as report_profiles
from benchmarks.gpu_report import result as report_result
from benchmarks.gpu_report import run as report_run
from sarathi_jax.bench.roofline import ModelShape, Rates, work
from sarathi_jax.sim.cost_model import Chunk

def check_figures(figures: list[dict]) -> None:
    for f in figures:
        assert set(f) == {"name", "value", "unit", "floor", "floor_basis", "ratio"}
        if f["floor"] is None:
            assert f["ratio"] is None and f["floor_basis"] is None
        else:
            assert f["floor"] > 0 and f["ratio"] == pytest.approx(f["value"] / f["floor"])
            assert f["floor_basis"] in ("bytes", "FLOPs")


def test_a_hung_and_a_failing_part_are_reported_and_the_rest_still_runs(tmp_path):
    out = tmp_path / "report"
    rc = report_run.main(["--smoke", "--out", str(out), "--parts", "machine,tune,profile_small",
                          "--inject", "machine=hang", "--budget", "machine=4", "--inject", "tune=fail"])
    assert rc == 1
    doc = json.loads((out / "report.json").read_text())
    parts = doc["parts"]
    machine, tune, profile = parts["machine"], parts["tune"], parts["profile_small"]
    assert machine["status"] == "timeout" and "killed" in machine["error"] and 4 <= machine["seconds"] < 20
    assert machine["result"] == {"figures": [], "tables": [], "info": {}}  # what it saved before hanging
    assert tune["status"] == "failed" and "injected failure in part 'tune'" in tune["error"]
    assert doc["tuning_table_used"] is None and not (out / "tuning_table.json").exists()
    assert profile["status"] == "ok"  # without the machine's rates: measured its own
    assert profile["result"]["info"]["rates_from"].startswith("measured in this part")
    check_figures(profile["result"]["figures"])
    skipped = {n for n, p in parts.items() if p["status"] == "skipped"}
    assert skipped == set(report_run.PART_NAMES) - {"machine", "tune", "profile_small"}
    assert all(parts[n]["error"] == "not selected (--parts)" for n in skipped)
    md = (out / "report.md").read_text()
    assert "**timeout**" in md and "**failed**" in md and "injected failure" in md


def test_no_part_starts_after_the_deadline(tmp_path):
    assert report_run.main(["--out", str(tmp_path), "--deadline-s", "10"]) == 0
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["finished"] and not doc["smoke"] and doc["config"]["large_model"] == "mistral-7b"
    assert all(p["status"] == "skipped" and p["error"].startswith("out of time") for p in doc["parts"].values())
    assert "Rates: the machine part gave none" in (tmp_path / "report.md").read_text()


def test_bad_arguments_exit(tmp_path):
    for argv in (["--parts", "nope"], ["--budget", "machine"], ["--inject", "nope=fail"]):
        with pytest.raises(SystemExit):
            report_run.main(["--out", str(tmp_path), *argv])


def test_a_traced_section_has_its_floor_the_busy_fraction_and_kernel_shares(tmp_path):
    shape = ModelShape(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, vocab_size=100, itemsize=2)
    works = [work(shape, [Chunk(100, 1)] * 4)]
    rates = Rates(matmul_flops=1e12, bandwidth=1e9)
    res = report_result.Result(str(tmp_path / "r.json"))
    summary = {"steps": 2, "wall_us_per_step": 1000.0, "device_busy_us_per_step": 400.0,
               "device_busy_fraction": 0.4, "kernels_per_step": 3.0,
               "top_kernels": [("fusion.1", 300.0, 2.0), ("gemm", 100.0, 1.0)], "top_host_events": []}
    report_profiles.add_section(res, "decode", summary, works, rates, {"trace": "t.json.gz"})
    floor = works[0].bytes / 1e9  # memory-bound: bytes over bandwidth
    wall, nbytes, flops, tokens, busy, fraction, kernels = res.doc["figures"]
    assert (nbytes["value"], flops["value"], tokens["value"]) == (works[0].bytes, works[0].flops, 4)
    assert (wall["value"], wall["floor"], wall["floor_basis"]) == (1e-3, pytest.approx(floor), "bytes")
    assert busy["ratio"] == pytest.approx(4e-4 / floor) and fraction["value"] == 0.4 and kernels["floor"] is None
    (table,) = res.doc["tables"]
    assert [row[3] for row in table["rows"]] == [0.75, 0.25]
    assert res.doc["sections"]["decode"]["trace"] == "t.json.gz"
    res.save()
    assert json.loads((tmp_path / "r.json").read_text())["figures"][0]["name"] == "decode: wall per step"


def test_attention_mixes_scale_and_keep_their_kind():
    from pallas_kernels.cases import SUITE

    assert report_parts.attention_cases(tuple(range(6)), 1) == list(SUITE)
    names = [c.name for c in report_parts.attention_cases(tuple(range(6)), 32)]
    assert names == ["2 decodes x ctx 32", "8 decodes x ctx 64", "1 decode x ctx 512",
                     "1 decode x ctx 32 + 16-token chunk at ctx 48", "prefill 64 tokens", "16-token chunk at ctx 48"]


def test_markdown_says_which_part_was_running_when_the_run_stopped():
    run = report_run.PartRun("Machine", status="running", budget_s=45)
    doc = {"command": "python -m benchmarks.gpu_report --out X", "started_at": "t", "elapsed_s": 3.0,
           "finished": False, "smoke": False, "config": {"dtype": "bfloat16"}, "tuning_table_used": None,
           "parts": {"machine": vars(run)}}
    md = report_md.render(doc)
    assert "**stopped or still running during `machine`**" in md and "| machine | running | - | 45 |" in md
    assert report_md.fmt_value(2.5e-3, "s") == "2.5 ms" and report_md.fmt_value(3e-6, "s") == "3 us"
    assert report_md.fmt_value(8.86e14, "FLOP/s") == "886 TFLOP/s"
    assert report_md.fmt_value(2.95e12, "B/s") == "2.95 TB/s" and report_md.fmt_value(0.62, "fraction") == "62%"


def test_a_report_stopped_from_outside_ends_its_running_part_and_says_where_it_stopped(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_report", "--smoke", "--out", str(out),
                             "--parts", "machine", "--inject", "machine=hang"], cwd=report_run.REPO_ROOT)
    deadline = time.monotonic() + 60
    while not _children_of(out) and time.monotonic() < deadline:  # the part's process is up
        time.sleep(0.2)
    assert _children_of(out)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    time.sleep(0.5)
    assert not _children_of(out)  # the hung part went with the report
    doc = json.loads((out / "report.json").read_text())
    assert doc["parts"]["machine"]["status"] == "running" and not doc["finished"]
    assert "**stopped or still running during `machine`**" in (out / "report.md").read_text()


def _children_of(out) -> list[int]:
    """Pids of the part processes working for the report in `out` (their command lines name it)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"benchmarks.gpu_report.parts" in cmdline and str(out).encode() in cmdline:
            pids.append(int(proc.name))
    return pids
