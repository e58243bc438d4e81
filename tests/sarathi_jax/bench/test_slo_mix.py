"""SLO classes (--slo-mix): parsing and its errors, the seeded class draw, goodput overall and per class on a
hand-made run with a known answer, the goodput target of a capacity search, and the bench end to end in the
simulator: priorities per class reach the engine, goodput per class in the table."""

from __future__ import annotations

import json

import pytest

from sarathi_jax.bench.__main__ import main
from sarathi_jax.bench.metrics import RequestRecord, RequestSlo, class_goodput, summarize
from sarathi_jax.bench.slo_mix import GoodputTarget, SloClass, parse_goodput_target, parse_slo_mix, request_slos

SPEC = "interactive:0.2:ttft=0.5,tbt=0.05,priority=-1;batch:0.8:ttft=30,tbt=1"


def test_parse_an_interactive_and_batch_mix():
    mix = parse_slo_mix(SPEC)
    assert mix.classes == (SloClass("interactive", 0.2, 0.5, 0.05, -1), SloClass("batch", 0.8, 30.0, 1.0, 0))
    assert parse_slo_mix("only:1:tbt=0.1").classes == (SloClass("only", 1.0, None, 0.1, 0),)


@pytest.mark.parametrize("spec,words", [
    ("", "empty"),
    ("a:1", "NAME:SHARE:TARGETS"),
    ("a:0.5:ttft=1;b:0.4:ttft=1", "add up to 0.9"),
    ("a:1:ttft=0", "ttft must be a positive"),
    ("a:1:tbt=-0.5", "tbt must be a positive"),
    ("a:1:ttft=inf", "ttft must be a positive"),
    ("a:1:ttft=soon", "ttft must be a number"),
    ("a:1:priority=1", "give a ttft= or tbt="),
    ("a:1:ttft=1,deadline=3", "'deadline=3' is not"),
    ("a:1:ttft=1,ttft=2", "ttft given twice"),
    ("a:1:ttft=1,priority=high", "priority must be an integer"),
    ("a:1:ttft=1,priority=2147483648", "outside"),
    ("a:0.5:ttft=1;a:0.5:ttft=2", "must differ"),
    ("a b:1:ttft=1", "class name"),
    ("a:0:ttft=1;b:1:ttft=1", "share must be in (0, 1]"),
])
def test_bad_specs_are_refused_clearly(spec, words):
    with pytest.raises(ValueError, match="^--slo-mix: ") as info:
        parse_slo_mix(spec)
    assert words in str(info.value)


def test_class_draw_is_seeded_and_follows_the_shares():
    mix = parse_slo_mix(SPEC)
    a, b = mix.assign(2000, seed=3), mix.assign(2000, seed=3)
    assert a == b and a != mix.assign(2000, seed=4)
    share = sum(c.name == "interactive" for c in a) / len(a)
    assert 0.17 < share < 0.23


def _record(i: int, ttft: float | None, tbts: list[float], reason: str | None = "length") -> RequestRecord:
    r = RequestRecord(f"r{i}", arrival_time=float(i), prompt_len=4, max_tokens=len(tbts) + 1)
    if ttft is not None:
        r.first_token_time = r.arrival_time + ttft
        r.token_times = [r.first_token_time]
        for t in tbts:
            r.token_times.append(r.token_times[-1] + t)
        r.finished_time = r.token_times[-1]
        r.num_output_tokens = len(r.token_times)
    r.finish_reason = reason
    return r


def test_goodput_per_class_on_a_hand_made_run():
    fast, slow = RequestSlo("interactive", 0.5, 0.05), RequestSlo("batch", 30.0, 1.0)
    records = [
        _record(0, 0.4, [0.04, 0.05]),  # interactive, good (a TBT exactly at the target counts)
        _record(1, 0.6, [0.01]),  # interactive, TTFT late
        _record(2, 0.1, [0.01, 0.06]),  # interactive, one token late: every token has a deadline, not the P99
        _record(3, 20.0, [0.9, 0.5]),  # batch, good
        _record(4, None, [], reason="abort"),  # batch, never completed
        _record(5, 29.0, [1.0]),  # batch, good; finishes last, at 5 + 29 + 1 = 35 s
    ]
    got = class_goodput(records, [fast, fast, fast, slow, slow, slow])
    # The span: first arrival (0 s) to last finish (35 s) of the completed requests.
    assert got["overall"]["num_good"] == 3 and got["overall"]["good_fraction"] == pytest.approx(0.5)
    assert got["overall"]["goodput"] == pytest.approx(3 / 35)
    inter, batch = got["classes"]["interactive"], got["classes"]["batch"]
    assert (inter["num_requests"], inter["num_good"], batch["num_requests"], batch["num_good"]) == (3, 1, 3, 2)
    assert inter["goodput"] == pytest.approx(1 / 35) and batch["good_fraction"] == pytest.approx(2 / 3)
    assert inter["slo_ttft"] == 0.5 and batch["slo_tbt"] == 1.0
    assert inter["ttft"]["p50"] == pytest.approx(0.4) and batch["ttft"]["p50"] == pytest.approx(24.5)
    summary = summarize(records, request_slos=[fast, fast, fast, slow, slow, slow])
    assert summary["slo_classes"] == got
    with pytest.raises(ValueError, match="5 SLOs for 6 requests"):
        class_goodput(records, [fast] * 5)
    target = GoodputTarget(0.5)
    assert target.met(summary) and not GoodputTarget(0.34, "interactive").met(summary)
    assert GoodputTarget(0.6, "batch").good_fraction(summary) == pytest.approx(2 / 3)


def test_goodput_target_parsing():
    mix = parse_slo_mix(SPEC)
    assert parse_goodput_target("0.9", mix) == GoodputTarget(0.9)
    assert parse_goodput_target("0.9:interactive", mix) == GoodputTarget(0.9, "interactive")
    with pytest.raises(ValueError, match="unknown SLO class 'chat'; the mix has interactive, batch"):
        parse_goodput_target("0.9:chat", mix)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        parse_goodput_target("90", mix)
    with pytest.raises(ValueError, match="needs --slo-mix"):
        parse_goodput_target("0.9", None)
    assert [s.slo_class for s in request_slos(mix.classes)] == ["interactive", "batch"]


BENCH = ["--simulate", "--scheduler", "sarathi", "--token-budget", "128", "--num-requests", "60", "--qps", "6",
         "--prompt-len", "uniform:64:512", "--output-len", "uniform:8:32", "--slo-mix", SPEC, "--quiet"]


def test_bench_reports_goodput_per_class_and_sends_class_priorities(tmp_path, capsys):
    ttft = {}
    for policy in ("fcfs", "priority"):
        out = tmp_path / policy
        assert main([*BENCH, "--scheduling-policy", policy, "--out", str(out), "--no-plots"]) == 0
        text = capsys.readouterr().out
        assert "goodput (own SLOs)" in text and "SLO classes" in text and "interactive" in text
        classes = json.load(open(out / "summary.json"))["runs"][0]["summary"]["slo_classes"]["classes"]
        assert set(classes) == {"interactive", "batch"}
        assert sum(c["num_requests"] for c in classes.values()) == 60
        ttft[policy] = classes["interactive"]["ttft"]["p99"]
    assert ttft["priority"] < ttft["fcfs"]  # the interactive class (priority -1) waits less


@pytest.mark.parametrize("argv,words", [
    (["--slo-mix", "a:1:ttft=-1"], "ttft must be a positive"),
    (["--slo-mix", "a:1:ttft=1", "--capacity", "--capacity-goodput", "0.9:b"], "unknown SLO class 'b'"),
    (["--capacity", "--capacity-goodput", "0.9"], "needs --slo-mix"),
    (["--slo-mix", "a:1:ttft=1", "--capacity-goodput", "0.9"], "criterion of --capacity"),
    (["--slo-mix", "a:1:ttft=1", "--capacity", "--capacity-goodput", "0.9", "--slo-tbt", "0.1"], "not both"),
])
def test_bench_refuses_bad_slo_options(argv, words, capsys):
    assert main(["--simulate", "--quiet", *argv]) != 0
    assert words in capsys.readouterr().err


def test_capacity_search_on_goodput(tmp_path):
    argv = [*BENCH, "--capacity", "--capacity-goodput", "0.9:interactive",
            "--capacity-probes", "5", "--out", str(tmp_path), "--no-plots"]
    assert main(argv) == 0
    cap = json.load(open(tmp_path / "summary.json"))["capacity"]["sarathi-128"]
    probes = cap["probes"]
    assert len(probes) == 5 and cap["slo_tbt"] is None
    assert all(p["passed"] == (p["good_fraction"] >= 0.9) for p in probes)
    assert any(p["passed"] for p in probes) and not all(p["passed"] for p in probes)
    assert cap["capacity_qps"] == max(p["qps"] for p in probes if p["passed"])



def test_runs_send_each_request_with_its_class_targets():
    """run_workload adds request i with its class's priority and SLO targets, so the engine sees them."""
    from sarathi_jax.bench.driver import run_workload
    from sarathi_jax.bench.workload import synthetic_workload
    from sarathi_jax.scheduler import SchedulerConfig
    from sarathi_jax.sim.simulator import SimulatedEngine

    class Spy(SimulatedEngine):
        seen: dict = {}

        def add_request(self, request_id, prompt, params=None, arrival_time=None, priority=0, **slo):
            self.seen[request_id] = (priority, slo)
            super().add_request(request_id, prompt, params, arrival_time, priority, **slo)

    mix = parse_slo_mix(SPEC)
    wl = synthetic_workload(12, qps=50.0, prompt_len="32", output_len="4", seed=3)
    classes = mix.assign(len(wl), 3)
    engine = Spy(SchedulerConfig(token_budget=64, max_num_seqs=8, max_model_len=256), num_blocks=128)
    run_workload(engine, wl, wl.prompts(1000, 3), id_prefix="r", request_classes=classes)
    assert {c.name for c in classes} == {"interactive", "batch"}
    assert [engine.seen[f"r{i}"] for i in range(len(wl))] == [
        (c.priority, {"slo_ttft_s": c.ttft, "slo_tbt_s": c.tbt}) for c in classes]
