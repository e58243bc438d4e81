"""The capacity experiment's script (`python -m benchmarks.gpu_capacity`): its bench commands, and the whole
pipeline (bench runs, report, plot, machine description) on the simulated engine. `--smoke` on the real engine
runs the same pipeline with tiny-llama in a few minutes; it is not run here. `--smoke --simulate --verify 1` is:
calibration on this CPU, the simulated grid and one point on the real engine."""

from __future__ import annotations

import json

import pytest

from tests.sarathi_jax.bench.bench_fakes import sim_engine

from benchmarks.gpu_capacity import main


def _traces(folder):
    folder.mkdir()
    (folder / "arxiv_summarization.csv").write_text(
        "num_prefill_tokens,num_decode_tokens\n" + "".join(f"{40 + i},{20 + i}\n" for i in range(30)))
    (folder / "splitwise_conv.csv").write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(f"{i * 0.5},{30 + i},{10 + i}\n" for i in range(30)))
    return folder


def test_dry_run_prints_the_papers_configurations(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4  # 2 traces x 2 SLOs
    for needle in ("--model mistral-7b", "--dtype bfloat16", "--scheduler sarathi,vllm,orca", "--token-budget 512,2048",
                   "--capacity"):
        assert all(needle in line for line in lines), needle
    assert "--slo-tbt-multiple 5" in lines[0] and "--slo-tbt-multiple 25" in lines[1]
    assert "--trace arxiv " in lines[0] and "--trace conversation " in lines[2]  # the shipped traces, by name
    assert (tmp_path / "commands.sh").read_text().count("python -m sarathi_jax.bench ") == 4


def test_dry_run_of_the_simulated_grid(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--dry-run", "--simulate", "--devices", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    for needle in ("--simulate", f"--cost-model {tmp_path / 'cost_model.json'}", "--sample 2048",
                   "--capacity-probes 8", "--decode-probe-batch 32", "--decode-probe-context 4064", "--devices 2"):
        assert all(needle in line for line in lines), needle


def test_the_simulated_grids_flags_are_checked(tmp_path, capsys):
    for extra in (["--verify", "1"], ["--devices", "2"], ["--cost-model", "cost.json"]):
        assert main(["--out", str(tmp_path), "--dry-run", *extra]) == 2
        assert "add --simulate" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--simulate", "--devices", "2", "--verify", "1"]) == 2
    assert "--verify runs the real engine on one device" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--simulate", "--verify-sample", "0"]) == 2


def test_smoke_simulated_grid_with_a_real_point(tmp_path, capsys):
    """As a user runs it on a CPU: the cost model calibrated here, the grid in the simulator (every policy, trace
    and SLO), one of its points searched again on the real engine beside the simulator on the same requests."""
    from sarathi_jax.sim.cost_model import BucketCostModel, Chunk

    out = tmp_path / "out"
    assert main(["--out", str(out), "--smoke", "--simulate", "--verify", "1"]) == 0
    cost = BucketCostModel.load(str(out / "cost_model.json"))
    assert cost.source["platform"] == "cpu" and cost.source["kv_cache_bytes"] > 0
    # The SLOs' reference is the cost model's price of a decode iteration of 4 requests at context 64 to 96.
    decode = json.loads((out / "decode_time.json").read_text())["decode_only_iteration_time"]
    assert cost.chunks_time([Chunk(64, 1)] * 4) <= decode <= cost.chunks_time([Chunk(96, 1)] * 4)
    table = json.loads((out / "capacity.json").read_text())
    for trace in ("arxiv", "conversation"):
        for slo, multiple in (("strict", 5), ("relaxed", 25)):
            entry = table[trace][slo]
            assert entry["slo_tbt"] == pytest.approx(multiple * decode)
            assert set(entry["capacity"]) == {"sarathi-32", "sarathi-64", "vllm", "orca"}
            assert all(len(p) >= 1 for p in entry["probes"].values())
    report = (out / "capacity.md").read_text()
    assert "Simulated: model tiny-llama" in report and "calibrated on cpu" in report
    machine = json.loads((out / "machine.json").read_text())
    assert machine["cost_model"]["source"]["platform"] == "cpu"
    assert machine["experiment"]["kv_cache_bytes"] == cost.source["kv_cache_bytes"]  # the calibrated engine's
    row, = json.loads((out / "verify.json").read_text())["rows"]
    assert (row["trace"], row["slo"], row["label"]) == ("arxiv", "strict", "sarathi-32")
    assert row["slo_tbt"] == table["arxiv"]["strict"]["slo_tbt"]
    for side, simulated in (("sim", True), ("real", False)):
        summary = json.loads((out / "verify" / "arxiv-strict-sarathi-32" / side / "summary.json").read_text())
        assert summary["slo_tbt"] == row["slo_tbt"] and summary["simulate"] is simulated
        assert row[side]["probes"] >= 1
    if row["real"]["capacity"]:
        assert row["error"] == pytest.approx(row["sim"]["capacity"] / row["real"]["capacity"] - 1)
    assert "| arxiv | strict" in (out / "verify.md").read_text()


def test_a_simulated_run_already_in_the_folder_is_kept(tmp_path, capsys):
    """A later invocation (for example `--verify N` on a GPU, after the grid ran on a CPU) keeps the simulated runs
    made with the same command line, and simulates again those whose command line changed."""
    from sarathi_jax.sim.cost_model import BucketCostModel

    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(BucketCostModel({4: 0.004, 64: 0.008}, 1e-7, 1e-8).to_dict()))
    argv = ["--out", str(tmp_path / "out"), "--smoke", "--simulate", "--cost-model", str(cost), "--traces", "arxiv",
            "--slos", "strict", "--sample", "8"]
    assert main(argv) == 0
    first = json.loads((tmp_path / "out" / "capacity.json").read_text())
    capsys.readouterr()
    assert main(argv) == 0
    assert "kept: " in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "capacity.json").read_text()) == first
    assert main(argv[:-1] + ["10"]) == 0  # another sample: simulated again
    assert "kept: " not in capsys.readouterr().out
    assert (tmp_path / "out" / "commands.sh").read_text().count("python -m sarathi_jax.bench ") == 2


def test_a_relative_trace_dir_is_the_current_directory(tmp_path, monkeypatch, capsys):
    _traces(tmp_path / "traces")
    monkeypatch.chdir(tmp_path)
    assert main(["--out", "out", "--dry-run", "--trace-dir", "traces", "--traces", "arxiv", "--slos", "strict"]) == 0
    line, = capsys.readouterr().out.strip().splitlines()
    assert f"--trace {tmp_path / 'traces' / 'arxiv_summarization.csv'} " in line


def test_pipeline_on_the_simulated_engine(tmp_path, capsys):
    built = []

    def factory(kwargs):  # a step's cost grows with the batch: a tight SLO fails at high rates
        built.append(kwargs)
        return sim_engine(base=0.01, per_seq=0.002, per_prefill_token=1e-4, max_model_len=kwargs["max_model_len"])

    out = tmp_path / "out"
    rc = main(["--out", str(out), "--smoke", "--trace-dir", str(_traces(tmp_path / "traces")), "--sample", "12",
               "--capacity-probes", "3"], engine_factory=factory)
    assert rc == 0
    assert {(k["scheduler"], k["token_budget"]) for k in built} == {("sarathi", 32), ("sarathi", 64), ("vllm", 64),
                                                                     ("orca", 64)}
    commands = (out / "commands.sh").read_text().splitlines()
    # The first run measures the decode-only iteration time; the others get its multiples in seconds.
    assert "--slo-tbt-multiple 5" in commands[0] and all("--slo-tbt " in c for c in commands[1:])
    table = json.loads((out / "capacity.json").read_text())
    assert set(table) == {"arxiv", "conversation"} and all(set(t) == {"strict", "relaxed"} for t in table.values())
    strict, relaxed = table["arxiv"]["strict"], table["arxiv"]["relaxed"]
    assert relaxed["slo_tbt"] == 5 * strict["slo_tbt"]
    assert set(strict["capacity"]) == {"sarathi-32", "sarathi-64", "vllm", "orca"}
    report = (out / "capacity.md").read_text()
    assert "| best sarathi / vllm |" in report and "2.6x" in report and "### conversation" in report
    machine = json.loads((out / "machine.json").read_text())
    assert machine["versions"]["jax"] and machine["experiment"]["model"] == "tiny-llama"
    assert (out / "capacity.png").stat().st_size > 0
    assert (out / "arxiv-strict" / "sarathi-32-sarathi-64-vllm-orca" / "summary.json").exists()


def test_bench_without_model_picks_the_platforms_default(capsys):
    import jax

    from sarathi_jax.bench.__main__ import default_model
    from sarathi_jax.bench.__main__ import main as bench_main

    built = []
    rc = bench_main(["--num-requests", "2", "--prompt-len", "8", "--output-len", "2", "--quiet"],
                    engine_factory=lambda kw: built.append(kw) or sim_engine())
    assert rc == 0 and built[0]["model"] == default_model(jax.default_backend())


def test_pieces_into_one_folder_make_one_report(tmp_path, capsys):
    # A device lent a few minutes per command: one policy and SLO at a time, the same DIR, one report at the end.
    traces = str(_traces(tmp_path / "traces"))
    out = tmp_path / "out"

    def factory(kw):
        return sim_engine(base=0.01, per_seq=0.002, max_model_len=kw["max_model_len"])

    for policies, slo in (("sarathi", "strict"), ("vllm", "strict"), ("vllm", "relaxed")):
        rc = main(["--out", str(out), "--smoke", "--trace-dir", traces, "--traces", "arxiv", "--slos", slo,
                   "--policies", policies, "--sample", "8", "--capacity-probes", "2"], engine_factory=factory)
        assert rc == 0
    commands = (out / "commands.sh").read_text().splitlines()
    assert len(commands) == 3 and "--slo-tbt-multiple 5" in commands[0]
    decode = json.loads((out / "decode_time.json").read_text())["decode_only_iteration_time"]
    assert f"--slo-tbt {5 * decode!r}" in commands[1] and f"--slo-tbt {25 * decode!r}" in commands[2]
    table = json.loads((out / "capacity.json").read_text())
    assert set(table["arxiv"]["strict"]["capacity"]) == {"sarathi-32", "sarathi-64", "vllm"}
    assert set(table["arxiv"]["relaxed"]["capacity"]) == {"vllm"}
    assert main(["--out", str(out), "--policies", "tgi"]) == 2


def test_report_caps_a_capacity_above_the_completion_rate(tmp_path):
    """Probes too short to build a queue pass at any rate: the report shows the fastest completion rate as an
    upper bound ("<="), not the rate the search reached, and the ratio uses the bound."""
    from benchmarks.gpu_capacity import Experiment, collect, format_report

    def capacity(qps, top, fail=None):
        return {"capacity_qps": qps, "bracket": [qps, fail], "max_throughput": top, "beyond_throughput": qps > 1.25 * top,
                "probes": [{"qps": qps, "passed": True}] + ([{"qps": fail, "passed": False}] if fail else [])}

    folder = tmp_path / "arxiv-strict" / "sarathi-512-vllm"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"slo_tbt": 0.06, "capacity": {
        "sarathi-512": capacity(16.0, 4.58), "vllm": capacity(1.0, 0.95, fail=1.5)}}))
    table = collect(str(tmp_path))
    strict = table["arxiv"]["strict"]
    assert strict["capacity"] == {"sarathi-512": 4.58, "vllm": 1.0}
    assert strict["bound"] == {"sarathi-512": "<=", "vllm": ""}
    report = format_report(table, Experiment(), 0.0124, {"platform": "gpu", "devices": ["H100"]})
    assert "| sarathi-512 | <=4.58 |" in report and "| vllm | 1 |" in report and "**4.58x** (from bounds)" in report
