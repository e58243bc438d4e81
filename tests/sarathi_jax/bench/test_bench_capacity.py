"""Driver and capacity search on the simulator (the real engine core and scheduler on a virtual clock) with a
step cost that grows with load (bench_fakes.sim_engine)."""

from __future__ import annotations

import numpy as np
import pytest
from bench_fakes import sim_engine

from sarathi_jax.bench.capacity import find_capacity, meets_slos, search
from sarathi_jax.bench.driver import measure_decode_iteration_time, run_workload
from sarathi_jax.bench.metrics import summarize
from sarathi_jax.bench.workload import Workload, synthetic_workload


def probe_fn(threshold):
    from sarathi_jax.bench.capacity import Probe

    return lambda q: Probe(qps=q, passed=q <= threshold)


@pytest.mark.parametrize("start", [1.0, 37.3, 500.0])
def test_search_brackets_then_bisects(start):
    cap, probes, (lo, hi), note = search(probe_fn(37.3), start_qps=start, max_probes=30, rel_tol=0.01)
    assert lo == cap <= 37.3 < hi and hi - lo <= 0.01 * hi and note == ""
    assert cap > 37.3 * 0.98


def test_search_is_bounded():
    cap, probes, (lo, hi), note = search(probe_fn(37.3), start_qps=1.0, max_probes=7, rel_tol=1e-6)
    assert len(probes) == 7 and lo <= 37.3 < hi and "probe limit" in note
    cap, probes, _, note = search(probe_fn(1e9), start_qps=1.0, max_probes=5)
    assert cap == 16.0 and "at least" in note
    cap, probes, _, note = search(probe_fn(-1), start_qps=1.0, max_probes=5)
    assert cap == 0.0 and "below" in note


def test_meets_slos():
    s = {"num_requests": 2, "num_completed": 2, "tbt": {"p99": 0.02}, "scheduling_delay": {"p50": 1.0}}
    assert meets_slos(s, 0.02, 2.0)
    assert not meets_slos(s, 0.019, 2.0)
    assert not meets_slos(s, 0.02, 0.5)
    assert not meets_slos({**s, "num_completed": 1}, 0.02, 2.0)


def test_driver_rebases_times_and_reuses_engine():
    eng = sim_engine(base=0.01, per_seq=0.001)
    wl = Workload([0.0, 0.5, 0.5], [3, 4, 5], [2, 3, 1])
    prompts = wl.prompts(1000, 0)
    r1 = run_workload(eng, wl, prompts, id_prefix="a-")
    r2 = run_workload(eng, wl, prompts, id_prefix="b-")
    for r in (r1, r2):
        recs = r.records
        assert [x.request_id[2:] for x in recs] == ["0", "1", "2"]
        assert [x.arrival_time for x in recs] == pytest.approx([0.0, 0.5, 0.5])
        assert [x.num_output_tokens for x in recs] == [2, 3, 1]
        # request 0 alone: one step of .011 -> first token at .011, second at .022
        assert recs[0].token_times == pytest.approx([0.011, 0.022])
        assert recs[0].ttft == pytest.approx(0.011) and recs[0].scheduling_delay == pytest.approx(0.0)
        # requests 1 and 2 together from t=.5, steps of .012 then .011
        assert recs[1].token_times == pytest.approx([0.512, 0.523, 0.534])
        assert recs[2].finished_time == pytest.approx(0.512)
        assert [it["start_time"] for it in r.iterations] == pytest.approx([0.0, 0.011, 0.5, 0.512, 0.523])
    assert len(eng.iteration_log) == 10


def test_driver_records_rejected_requests():
    # Admission refuses (add_request raises AdmissionError, as LLMEngine's does) both a prompt + max_tokens
    # beyond max_model_len and a prompt >= max_model_len; the driver records each as an error, never run.
    eng = sim_engine(max_model_len=10)
    wl = Workload([0.0, 0.0, 0.0], [3, 9, 12], [2, 5, 1])
    r = run_workload(eng, wl, wl.prompts(1000, 0))
    ok, too_long, refused = r.records
    assert ok.completed and ok.num_output_tokens == 2
    assert too_long.finish_reason == "error" and "exceeds max_model_len (10)" in too_long.error
    assert not too_long.completed and too_long.num_output_tokens == 0
    assert refused.finish_reason == "error" and "leave no room" in refused.error and not refused.completed


def test_decode_only_iteration_time():
    eng = sim_engine(base=0.01, per_seq=0.0001)
    assert measure_decode_iteration_time(eng, batch_size=8) == pytest.approx(0.0108)


def test_capacity_finds_known_threshold():
    # Each request takes L=100 steps; a step lasts base + c * n for n running requests. At a constant arrival
    # rate q the steady state has n = q * L * step, so TBT = step = base / (1 - q * L * c). The P99 TBT SLO
    # S = 2 * base is met up to q* = (1 - base / S) / (L * c) = 50 req/s.
    eng = sim_engine(base=0.01, per_seq=0.0001)
    base = synthetic_workload(400, qps=10.0, prompt_len="8", output_len="100", arrival="constant", seed=0)
    res = find_capacity(eng, base, base.prompts(1000, 0), slo_tbt=0.02, max_probes=10, rel_tol=0.02)
    assert len(res.probes) <= 10
    assert 47.0 <= res.capacity_qps <= 53.0, res.to_dict()
    best = res.best
    assert best is not None and best.passed and best.p99_tbt <= 0.02
    # a rate well above q* fails; overloaded probes stop early instead of draining the whole queue
    failing = [p for p in res.probes if not p.passed]
    assert failing and all(p.qps > res.capacity_qps for p in failing)
    assert any(p.stopped_early for p in failing)


def test_capacity_limited_by_scheduling_delay():
    # With at most M=10 running, throughput is mu = M / (L * (base + c * M)) = 10 / (50 * 0.011) = 18.2 req/s;
    # above it the queue grows: the k-th request waits about k * (1/mu - 1/q). The median (k = 300 of 600)
    # waits over 2 s once 1/q < 1/mu - 2/300, i.e. q > 20.7 req/s. TBT stays at .011 (SLO loose).
    eng = sim_engine(base=0.01, per_seq=0.0001, max_num_seqs=10)
    base = synthetic_workload(600, qps=5.0, prompt_len="8", output_len="50", arrival="constant", seed=0)
    res = find_capacity(eng, base, base.prompts(1000, 0), slo_tbt=1.0, max_sched_delay=2.0, max_probes=10,
                        rel_tol=0.02)
    assert 19.5 <= res.capacity_qps <= 21.5, res.to_dict()
    s = res.best.result.summary
    assert s["scheduling_delay"]["p50"] <= 2.0


def test_short_probes_are_capped_by_the_completion_rate():
    # The engine of the test above (throughput mu = 18.2 req/s), but 40 requests per probe: the median waits
    # at most 20 * (1/mu) = 1.1 s at any rate, so the scheduling-delay bound never fails and the search
    # passes rates far above mu. The fastest completion rate measured caps what the search may claim.
    eng = sim_engine(base=0.01, per_seq=0.0001, max_num_seqs=10)
    base = synthetic_workload(40, qps=20.0, prompt_len="8", output_len="50", arrival="constant", seed=0)
    res = find_capacity(eng, base, base.prompts(1000, 0), slo_tbt=1.0, max_sched_delay=2.0, max_probes=4)
    assert res.capacity_qps >= 80.0 and all(p.passed for p in res.probes)  # what the search alone says
    assert all(p.throughput is not None and p.throughput <= 18.3 for p in res.probes)
    assert 10.0 <= res.max_throughput <= 18.3, res.to_dict()
    assert res.beyond_throughput and "at most about" in res.note
    assert res.to_dict()["max_throughput"] == res.max_throughput


def test_summarize_probe_runs():
    eng = sim_engine()
    wl = synthetic_workload(20, qps=50.0, prompt_len="4", output_len="10", seed=1)
    r = run_workload(eng, wl, wl.prompts(1000, 0))
    s = summarize(r.records, r.iterations)
    assert s["num_completed"] == 20 and s["output_tokens"] == 200
    assert np.isclose(s["tbt"]["p50"], 0.01 + 0.0001 * np.median([it["num_seqs"] for it in r.iterations]), atol=2e-4)
