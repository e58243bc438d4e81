"""`server.session.ServerMetrics` on its own registry: the engine's stats become gauges, its cumulative totals
(preemptions, prefix-cache queries and hits) counters that never double-count, and requests are counted by reason. The /metrics
endpoint of a running server is in test_grpc_operations.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from server.session import ServerMetrics


def _value(m: ServerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value("sarathi:" + name, {"model_name": "tiny", **labels})


def test_engine_stats_become_gauges_and_a_monotonic_counter():
    m = ServerMetrics("tiny")
    m.update_engine_stats({"num_running": 3, "num_waiting": 2, "kv_cache_usage": 0.25, "num_preemptions": 2})
    assert (_value(m, "num_requests_running"), _value(m, "num_requests_waiting")) == (3, 2)
    assert _value(m, "kv_cache_usage_perc") == 0.25
    assert _value(m, "num_preemptions_total") == 2
    m.update_engine_stats({"num_running": 1, "num_preemptions": 5})  # the engine's count is cumulative
    assert _value(m, "num_preemptions_total") == 5 and _value(m, "num_requests_running") == 1
    assert _value(m, "num_requests_waiting") == 0  # a missing figure reads 0
    m.update_engine_stats({"num_preemptions": 5})
    m.update_engine_stats({"num_preemptions": 4})  # never counted twice, never backwards
    assert _value(m, "num_preemptions_total") == 5


def test_requests_are_counted_by_reason():
    m = ServerMetrics("tiny")
    m.request_finished("length")
    m.request_finished("length")
    m.request_finished("stop")
    m.request_rejected("queue_full")
    assert _value(m, "request_success_total", finished_reason="length") == 2
    assert _value(m, "request_success_total", finished_reason="stop") == 1
    assert _value(m, "request_rejected_total", reason="queue_full") == 1
    m.ttft.observe(0.03)
    m.itl.observe(0.002)
    assert _value(m, "time_to_first_token_seconds_count") == 1
    assert _value(m, "time_to_first_token_seconds_bucket", le="0.04") == 1
    assert _value(m, "time_to_first_token_seconds_bucket", le="0.02") == 0
    assert _value(m, "inter_token_latency_seconds_sum") == 0.002


def test_each_server_has_its_own_registry():
    a, b = ServerMetrics("tiny"), ServerMetrics("tiny")  # two servers in one process: no duplicate names
    a.request_finished("stop")
    assert _value(a, "request_success_total", finished_reason="stop") == 1
    assert _value(b, "request_success_total", finished_reason="stop") is None
    shared = CollectorRegistry()
    assert ServerMetrics("tiny", registry=shared).registry is shared


def test_engine_totals_become_counters():
    m = ServerMetrics("m")
    value = lambda name: m.registry.get_sample_value(f"sarathi:{name}_total", {"model_name": "m"})  # noqa: E731
    m.update_engine_stats({"num_preemptions": 1, "prefix_cache_queries": 100, "prefix_cache_hits": 64})
    m.update_engine_stats({"num_preemptions": 1, "prefix_cache_queries": 300, "prefix_cache_hits": 96})
    assert (value("num_preemptions"), value("prefix_cache_queries"), value("prefix_cache_hits")) == (1, 300, 96)
    m.update_engine_stats({})  # an engine without the counters leaves them alone
    assert value("prefix_cache_hits") == 96
    spec = {"spec_num_verify_steps": 3, "spec_num_draft_tokens": 12, "spec_num_accepted_tokens": 7,
            "spec_num_emitted_tokens": 10, "spec_acceptance_rate": 7 / 12}
    m.update_engine_stats(spec)
    m.update_engine_stats({**spec, "spec_num_verify_steps": 4, "spec_num_draft_tokens": 16})
    assert [value(f"spec_decode_num_{n}") for n in ("drafts", "draft_tokens", "accepted_tokens", "emitted_tokens")] \
        == [4, 16, 7, 10]


def test_kv_transfers_become_counters():
    """A disaggregated engine's transfer totals (`DisaggregationFlow.stats`): counters, seconds fractional."""
    m = ServerMetrics("tiny")
    m.update_engine_stats({"num_transfers": 2, "transfer_bytes": 4096, "transfer_seconds": 0.25})
    m.update_engine_stats({"num_transfers": 3, "transfer_bytes": 6144, "transfer_seconds": 0.375})
    assert (_value(m, "kv_transfers_total"), _value(m, "kv_transfer_bytes_total")) == (3, 6144)
    assert _value(m, "kv_transfer_seconds_total") == 0.375
    m.update_engine_stats({"num_running": 1})  # a colocated engine's stats leave them alone
    assert _value(m, "kv_transfers_total") == 3


def test_relegations_become_a_counter():
    m = ServerMetrics("tiny")
    m.update_engine_stats({"num_relegations": 3})
    m.update_engine_stats({"num_relegations": 4})
    assert _value(m, "num_relegations_total") == 4


def test_finished_requests_are_counted_by_slo_class_and_result():
    from sarathi_jax.request.outputs import RequestMetrics
    from server.session import SLO_CLASS_LABELS

    def finished(ttft_s, tbt_s, *, first, tokens=()):
        rm = RequestMetrics(arrival_time=0.0, slo_ttft_s=ttft_s, slo_tbt_s=tbt_s)
        rm.first_token_time, rm.token_times, rm.finished_time = first, [first, *tokens], 5.0
        return rm

    m = ServerMetrics("tiny")
    m.request_slo(finished(1.0, 0.1, first=0.5, tokens=(0.55, 0.6)))  # met
    m.request_slo(finished(1.0, 0.1, first=0.5, tokens=(0.8,)))  # a 0.3 s gap: missed
    m.request_slo(finished(1.0, 0.1, first=1.5))  # late first token: missed
    m.request_slo(finished(10.0, None, first=2.0))
    m.request_slo(finished(None, None, first=2.0))  # no targets: not counted
    assert _value(m, "request_slo_total", slo="ttft=1,tbt=0.1", result="met") == 1
    assert _value(m, "request_slo_total", slo="ttft=1,tbt=0.1", result="missed") == 2
    assert _value(m, "request_slo_total", slo="ttft=10", result="met") == 1
    for i in range(SLO_CLASS_LABELS):  # the label's values are bounded: later classes share "other"
        m.request_slo(finished(100.0 + i, None, first=1.0))
    assert _value(m, "request_slo_total", slo="other", result="met") == 2
