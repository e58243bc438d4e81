"""Metric functions against hand-computed values on a synthetic timeline."""

from __future__ import annotations

import pytest

from sarathi_jax.bench.metrics import (
    RequestRecord,
    all_tbts,
    count_stalls,
    decode_only_iteration_time,
    goodput,
    iteration_stats,
    summarize,
    throughput,
)

# A: arrives 0, scheduled 0.5, tokens at 1.0 1.1 1.2 1.3       -> TTFT 1.0, TBTs .1 .1 .1, e2e 1.3, sched .5
# B: arrives 0.5, scheduled 0.6, tokens at 0.8 1.0 2.0          -> TTFT .3, TBTs .2 1.0, e2e 1.5, sched .1
# C: arrives 1.0, scheduled 1.0, token at 1.5                   -> TTFT .5, no TBT, e2e .5, sched 0
# D: arrives 1.5, aborted before being scheduled
A = RequestRecord("A", 0.0, 10, 4, 4, 0.5, 1.0, [1.0, 1.1, 1.2, 1.3], 1.3, 0, "length")
B = RequestRecord("B", 0.5, 20, 3, 3, 0.6, 0.8, [0.8, 1.0, 2.0], 2.0, 1, "length")
C = RequestRecord("C", 1.0, 30, 1, 1, 1.0, 1.5, [1.5], 1.5, 0, "stop")
D = RequestRecord("D", 1.5, 40, 8, 0, None, None, [], 1.6, 0, "abort")
RECORDS = [A, B, C, D]


def test_per_request():
    assert A.ttft == pytest.approx(1.0) and B.ttft == pytest.approx(0.3) and C.ttft == pytest.approx(0.5)
    assert A.tbts == pytest.approx([0.1, 0.1, 0.1]) and B.tbts == pytest.approx([0.2, 1.0]) and C.tbts == []
    assert A.e2e_latency == pytest.approx(1.3) and B.e2e_latency == pytest.approx(1.5)
    assert A.scheduling_delay == pytest.approx(0.5) and B.scheduling_delay == pytest.approx(0.1)
    assert C.scheduling_delay == 0.0 and D.scheduling_delay is None and D.ttft is None
    assert A.normalized_latency == pytest.approx(1.3 / 4) and B.normalized_latency == pytest.approx(0.5)
    assert D.normalized_latency is None
    d = B.to_dict()
    assert d["ttft"] == pytest.approx(0.3) and d["token_times"] == [0.8, 1.0, 2.0]


def test_stalls():
    tbts = all_tbts([A, B, C])
    assert sorted(tbts) == pytest.approx([0.1, 0.1, 0.1, 0.2, 1.0])
    assert count_stalls(tbts) == 1  # median .1, threshold .5: only 1.0
    assert count_stalls(tbts, 1.5) == 2  # threshold .15: .2 and 1.0
    assert count_stalls(tbts, 5, reference=0.01) == 5
    assert count_stalls([]) == 0


def test_throughput_and_goodput():
    t = throughput(RECORDS)
    assert t["duration"] == pytest.approx(2.0)  # first arrival 0 to last completed finish 2.0
    assert t["num_completed"] == 3 and t["output_tokens"] == 8
    assert t["request_throughput"] == pytest.approx(1.5)
    assert t["output_token_throughput"] == pytest.approx(4.0)
    assert t["total_token_throughput"] == pytest.approx((8 + 60) / 2.0)
    g = goodput(RECORDS, slo_ttft=0.6, slo_tbt=0.5)  # A fails TTFT, B fails TBT (1.0), C good, D aborted
    assert g["num_good"] == 1 and g["goodput"] == pytest.approx(0.5) and g["good_fraction"] == 0.25
    assert goodput(RECORDS, slo_ttft=None, slo_tbt=1.0)["num_good"] == 3
    assert goodput(RECORDS, slo_ttft=1.0, slo_tbt=None)["num_good"] == 3


ITERS = [
    {"iteration": 0, "start_time": 0.0, "duration": 0.2, "num_prefill_tokens": 100, "num_decode_tokens": 0,
     "num_padded_tokens": 112},
    {"iteration": 1, "start_time": 0.2, "duration": 0.05, "num_prefill_tokens": 0, "num_decode_tokens": 4,
     "num_padded_tokens": 16},
    {"iteration": 2, "start_time": 0.25, "duration": 0.07, "num_prefill_tokens": 0, "num_decode_tokens": 4,
     "num_padded_tokens": 16},
    {"iteration": 3, "start_time": 0.4, "duration": 0.1, "num_prefill_tokens": 10, "num_decode_tokens": 3,
     "num_padded_tokens": 16},
]


def test_iteration_stats():
    assert decode_only_iteration_time(ITERS) == pytest.approx(0.06)
    s = iteration_stats(ITERS)
    assert s["num_iterations"] == 4 and s["num_hybrid_iterations"] == 1 and s["num_decode_only_iterations"] == 2
    assert s["num_prefill_tokens"] == 110 and s["num_decode_tokens"] == 11
    assert s["padding_efficiency"] == pytest.approx(121 / 160)
    assert s["mean_tokens_per_iteration"] == pytest.approx(121 / 4)
    assert decode_only_iteration_time(ITERS[:1]) is None


def test_summarize():
    s = summarize(RECORDS, ITERS, slo_ttft=0.6, slo_tbt=0.5)
    assert (s["num_requests"], s["num_completed"], s["num_aborted"], s["num_unfinished"]) == (4, 3, 1, 0)
    assert s["ttft"]["p50"] == pytest.approx(0.5)  # TTFTs .3 .5 1.0
    assert s["ttft"]["p90"] == pytest.approx(0.9)  # rank 1.8: .5 + .8 * .5
    assert s["tbt"]["p99"] == pytest.approx(0.968)
    assert s["e2e_latency"]["max"] == pytest.approx(1.5)
    assert s["scheduling_delay"]["p50"] == pytest.approx(0.1)
    assert s["normalized_latency"]["p50"] == pytest.approx(0.5)  # .325 .5 .5
    assert s["num_stalls"] == 1 and s["stall_threshold"] == pytest.approx(0.5)
    assert s["num_preemptions"] == 1  # from the records when not given
    assert s["goodput"]["num_good"] == 1
    assert s["iterations"]["decode_only_iteration_time"] == pytest.approx(0.06)
    assert summarize(RECORDS, num_preemptions=7)["num_preemptions"] == 7
