"""Helpers for the server tests: engine construction, a module-scoped server, polling, stubs."""

from __future__ import annotations

import time
from typing import Any, Callable

import grpc

from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc

# Small and quick to compile: 4 buckets (16..64 tokens), 16 sequences per step.
ENGINE_KW: dict[str, Any] = dict(token_budget=64, max_num_seqs=16, block_size=16, num_blocks=160, max_model_len=256)


def make_engine(model: Any, **overrides: Any):
    from sarathi_jax import EngineConfig, LLMEngine

    config = EngineConfig(model=str(model), **{**ENGINE_KW, **overrides})
    return LLMEngine(config), config


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01, what: str = "condition") -> Any:
    """Poll pred() until truthy (returned) or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def stub_for(target: str) -> tuple[grpc.Channel, pb_grpc.GenerationStub]:
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.GenerationStub(channel)


def get_stats(stub: pb_grpc.GenerationStub) -> pb.Stats:
    return stub.GetStats(pb.GetStatsRequest(), timeout=10)


def all_blocks_free(stub: pb_grpc.GenerationStub) -> bool:
    s = get_stats(stub)
    return s.num_free_blocks == s.num_total_blocks and s.num_running == 0 and s.num_waiting == 0
