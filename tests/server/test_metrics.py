"""ServerMetrics turns the engine's cumulative totals into Prometheus counters (vLLM's names, `sarathi:`)."""

from __future__ import annotations

from server.metrics import ServerMetrics


def test_engine_totals_become_counters():
    m = ServerMetrics("m")
    value = lambda name: m.registry.get_sample_value(f"sarathi:{name}_total", {"model_name": "m"})  # noqa: E731
    m.update_engine_stats({"num_preemptions": 1, "prefix_cache_queries": 100, "prefix_cache_hits": 64})
    m.update_engine_stats({"num_preemptions": 1, "prefix_cache_queries": 300, "prefix_cache_hits": 96})
    assert (value("num_preemptions"), value("prefix_cache_queries"), value("prefix_cache_hits")) == (1, 300, 96)
    m.update_engine_stats({})  # an engine without the counters leaves them alone
    assert value("prefix_cache_hits") == 96
