"""The bench's pieces one by one: options -> configurations (`args`), options -> workload and runs (`runs`),
and the printed report (`report.print_report`), on the fake simulated engine of bench_fakes."""

from __future__ import annotations

import math

import pytest
from bench_fakes import sim_engine

from sarathi_jax.bench.args import DEFAULT_NUM_REQUESTS, BenchError, build_parser, check_args, run_configs
from sarathi_jax.bench.driver import RunResult
from sarathi_jax.bench.report import policy_reading, print_report
from sarathi_jax.bench.runs import BenchRuns, build_workload, run_all


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_run_configs_expand_policies_budgets_and_prefix_caching():
    configs = run_configs(parse("--scheduler", "sarathi,vllm,sarathi", "--token-budget", "64,128",
                                "--prefix-caching", "off,on"))
    assert [(c["label"], c["scheduler"], c["token_budget"], c["prefix_caching"]) for c in configs] == [
        ("sarathi-64", "sarathi", 64, False), ("sarathi-64+prefix", "sarathi", 64, True),
        ("sarathi-128", "sarathi", 128, False), ("sarathi-128+prefix", "sarathi", 128, True),
        # a whole-prompt policy runs once, with the largest budget
        ("vllm", "vllm", 128, False), ("vllm+prefix", "vllm", 128, True),
    ]
    with pytest.raises(BenchError, match="unknown policy 'nope'"):
        run_configs(parse("--scheduler", "nope"))
    with pytest.raises(BenchError, match="could not parse"):
        run_configs(parse("--token-budget", "12x"))


def test_check_args_refuses_combinations_that_cannot_work():
    with pytest.raises(BenchError, match="either --slo-tbt or --slo-tbt-multiple"):
        check_args(parse("--slo-tbt", "0.1", "--slo-tbt-multiple", "5"))
    with pytest.raises(BenchError, match="--capacity needs a TBT SLO"):
        check_args(parse("--capacity"))
    with pytest.raises(BenchError, match="add --simulate"):
        check_args(parse("--cost-model", "x.json"))
    check_args(parse("--capacity", "--slo-tbt", "0.1"))  # fine: returns


def test_build_workload_defaults_offline_and_scaling():
    wl = build_workload(parse("--seed", "3"))
    assert len(wl) == DEFAULT_NUM_REQUESTS and math.isfinite(wl.mean_rate)
    offline = build_workload(parse("--offline", "--num-requests", "5", "--output-len", "7"))
    assert len(offline) == 5 and not math.isfinite(offline.mean_rate) and list(offline.output_lens) == [7] * 5
    with pytest.raises(BenchError, match="--sample needs --trace"):
        build_workload(parse("--sample", "3"))
    with pytest.raises(BenchError, match="no effect on an offline workload"):
        build_workload(parse("--offline", "--rate-scale", "2"))


def test_run_all_then_print_report(capsys):
    args = parse("--scheduler", "sarathi", "--token-budget", "64,128", "--num-requests", "6", "--qps", "50",
                 "--prompt-len", "16", "--output-len", "4", "--quiet")
    check_args(args)
    results = run_all(args, lambda kwargs: sim_engine(base=0.01, per_seq=0.001))
    assert isinstance(results, BenchRuns)
    assert [r.label for r in results.runs] == ["sarathi-64", "sarathi-128"]
    assert all(r.summary["num_completed"] == 6 for r in results.runs)
    assert set(results.workload_info) == {"sarathi-64", "sarathi-128"} and results.capacities == {}
    print_report(args, results)
    out = capsys.readouterr().out
    assert "sarathi-64" in out and "sarathi-128" in out and "P99 TBT" in out and "pass --out DIR" in out


def test_default_compares_sarathi_with_the_prefill_first_baseline(capsys):
    assert [(c["label"], c["scheduler"]) for c in run_configs(parse())] == [("sarathi-128", "sarathi"),
                                                                            ("vllm", "vllm")]
    args = parse("--num-requests", "8", "--qps", "50", "--prompt-len", "64", "--output-len", "6", "--quiet")
    print_report(args, run_all(args, lambda kwargs: sim_engine(base=0.01, per_seq=0.001, per_prefill_token=1e-4)))
    out = capsys.readouterr().out
    assert "sarathi-128" in out and "\nvllm " in out and "\nreading: sarathi-128: " in out
    assert "long on purpose" not in out  # the note is about the default prompts, and these were given
    args = parse("--num-requests", "4", "--qps", "50", "--output-len", "2", "--quiet")
    print_report(args, run_all(args, lambda kwargs: sim_engine(base=0.01, per_seq=0.001, per_prefill_token=1e-4)))
    assert "(the default prompts, uniform:256:960, are long on purpose" in capsys.readouterr().out


def _run(label: str, scheduler: str, stalls: int, p99_tbt: float, p50_ttft: float) -> RunResult:
    summary = {"num_stalls": stalls, "tbt": {"p99": p99_tbt}, "ttft": {"p50": p50_ttft}}
    return RunResult(label, [], [], 0, 1.0, config={"scheduler": scheduler}, summary=summary)


def test_policy_reading_says_which_way_the_difference_goes():
    sarathi, vllm = _run("sarathi-128", "sarathi", 0, 0.030, 0.070), _run("vllm", "vllm", 10, 0.060, 0.050)
    line = policy_reading([sarathi, vllm])
    assert line.startswith("reading: sarathi-128: 0 stalls, P99 TBT 30.0 ms; vllm: 10 stalls, P99 TBT 60.0 ms.")
    assert "2.0x lower P99 TBT" in line and "the price is time to first token (P50 70.0 ms against 50.0 ms)" in line
    no_gain = policy_reading([_run("sarathi-128", "sarathi", 3, 0.050, 0.05), _run("vllm", "vllm", 2, 0.040, 0.05)])
    assert "No stall-free advantage on this run" in no_gain and "lower P99 TBT" not in no_gain
    # a loaded run: sarathi's shorter median TBT makes more of its TBTs "stalls", but its tail is far shorter
    loaded = policy_reading([_run("sarathi-128", "sarathi", 79, 0.45, 2.0), _run("vllm", "vllm", 29, 8.1, 2.6)])
    assert "18.0x lower P99 TBT (more stalls: each run counts" in loaded and "No stall-free" not in loaded
    assert policy_reading([sarathi]) is None and policy_reading([vllm, _run("orca", "orca", 0, 0.01, 0.01)]) is None
