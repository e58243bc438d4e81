"""`python -m sarathi_jax.bench.fidelity` at smoke size: it calibrates a cost model on this CPU, runs the same
requests on the real engine and in the simulator, and compares them per configuration."""

from __future__ import annotations

import json

import pytest

from sarathi_jax.bench import fidelity
from sarathi_jax.bench.driver import RunResult

SMOKE = ["--model", "tiny-llama", "--scheduler", "sarathi,vllm", "--token-budget", "32", "--num-requests", "6",
         "--prompt-len", "uniform:16:64", "--output-len", "8", "--max-model-len", "256", "--quiet"]


def test_smoke_compares_every_configuration_on_both_sides(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert fidelity.main(SMOKE + ["--rates", "2,6", "--json", str(out), "--out", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert "largest |error|" in printed
    assert (tmp_path / "run" / "cost_model.json").exists()  # calibrated here, kept in --out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["label"]) for r in rows] == [
        ("synthetic @2.0", "sarathi-32"), ("synthetic @2.0", "vllm"), ("synthetic @6.0", "sarathi-32"),
        ("synthetic @6.0", "vllm")]
    for row in rows:
        assert row["completed"] == [6, 6]  # every request finished on both sides
        for name, _ in fidelity.METRICS:
            m = row[name]
            assert m["real"] > 0 and m["sim"] > 0
            assert m["error"] == pytest.approx(m["sim"] / m["real"] - 1)
    # The cost model records the platform it was calibrated on; given back, nothing is calibrated again.
    cost_model = tmp_path / "run" / "cost_model.json"
    assert json.loads(cost_model.read_text())["source"]["platform"] == "cpu"
    assert fidelity.main(SMOKE + ["--cost-model", str(cost_model), "--json", str(out)]) == 0
    assert "calibrating" not in capsys.readouterr().err
    assert [r["label"] for r in json.loads(out.read_text())["rows"]] == ["sarathi-32", "vllm"]


def test_compare_reads_the_summaries():
    def run(tbt50, tbt99, ttft50, ttft90, tput):
        summary = {"num_completed": 3, "tbt": {"p50": tbt50, "p99": tbt99}, "ttft": {"p50": ttft50, "p90": ttft90},
                   "output_token_throughput": tput}
        return RunResult("sarathi-128", [], [], 0, 1.0, summary=summary)

    row = fidelity.compare(run(0.01, 0.02, 0.1, 0.2, 100.0), run(0.011, 0.02, 0.05, None, 80.0))
    assert row["TBT p50"]["error"] == pytest.approx(0.1)
    assert row["TBT p99"]["error"] == pytest.approx(0.0)
    assert row["TTFT p50"]["error"] == pytest.approx(-0.5)
    assert row["TTFT p90"]["error"] is None
    assert row["output tok/s"]["error"] == pytest.approx(-0.2)


def test_the_command_sets_simulate_itself():
    with pytest.raises(SystemExit):
        fidelity.parse_args(SMOKE + ["--simulate"])
