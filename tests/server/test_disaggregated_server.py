"""The gRPC server over the real disaggregated engine: built from its config as the server's start
builds it (`build_engine`), served unchanged: unary and streamed greedy tokens equal HF's, and every KV block
is free on both sides once they are done; the KV transfers appear in GetStats and the Prometheus counters."""

from __future__ import annotations

import pytest
from grpc_test_utils import ENGINE_KW, all_blocks_free, greedy, serving, stub_for, wait_until

from server.client import make_request
from server.proto.sarathi.v1 import generation_pb2 as pb
from tests.sarathi_jax.engine_helpers import hf_generate

PROMPTS = [[5, 9, 33, 2, 71, 8, 14, 200, 3, 41, 17, 99, 23, 5, 6, 7, 8, 90, 91], [40, 41, 42]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def disaggregated(hf_checkpoint):
    from sarathi_jax import EngineConfig
    from sarathi_jax.disagg.real_engine import DisaggregatedEngine
    from sarathi_jax.factory import build_engine

    # token_budget 16: the 19-token prompt prefills in two chunks.
    config = EngineConfig(model=str(hf_checkpoint("llama")), disaggregation="1:1",
                          **{**ENGINE_KW, "num_blocks": 64, "token_budget": 16})
    engine = build_engine(config, warmup=False)
    assert isinstance(engine, DisaggregatedEngine)
    return engine, config


def test_grpc_serves_the_disaggregated_engine(disaggregated, hf_checkpoint):
    engine, _ = disaggregated
    expected = hf_generate(hf_checkpoint("llama"), PROMPTS, MAX_TOKENS)
    with serving(disaggregated) as srv:
        channel, stub = stub_for(srv.target)
        try:
            unary = stub.Complete(make_request(PROMPTS[0], max_tokens=MAX_TOKENS, **greedy()), timeout=120)
            stream = stub.Generate(make_request(PROMPTS[1], max_tokens=MAX_TOKENS, **greedy()), timeout=120)
            streamed = [t for msg in stream for t in msg.token_ids]
            assert [list(unary.token_ids), streamed] == expected
            wait_until(lambda: all_blocks_free(stub), what="every KV block free")
            # The transfers in GetStats and as Prometheus counters (the /metrics endpoint's registry).
            stats = engine.stats()
            reply = stub.GetStats(pb.GetStatsRequest(), timeout=10)
            assert (reply.num_transfers, reply.transfer_bytes) == (2, stats["transfer_bytes"])
            assert reply.transfer_bytes > 0 and reply.transfer_seconds == pytest.approx(stats["transfer_seconds"])
            assert reply.transfer_seconds > 0
            counter = lambda name: srv.metrics.registry.get_sample_value(  # noqa: E731
                f"sarathi:{name}_total", {"model_name": srv.model_name})
            assert (counter("kv_transfers"), counter("kv_transfer_bytes")) == (2, stats["transfer_bytes"])
            assert counter("kv_transfer_seconds") == pytest.approx(stats["transfer_seconds"])
        finally:
            channel.close()
    assert {r.instance for r in engine.iteration_log} == {"prefill0", "decode0"}
