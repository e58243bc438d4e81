"""`benchmarks.probes.loop_timing`: the loop benchmark's engine leaves room for every phase of a run."""

from __future__ import annotations

import pytest

from benchmarks.probes.loop_timing import LoopBenchConfig, engine_size


def test_engine_size_leaves_room_for_every_phase():
    cfg = LoopBenchConfig(batches=(1, 8), context=100, prompt_len=300, token_budget=64, steps=4, rounds=2)
    size = engine_size(cfg)
    assert size.max_model_len > cfg.prompt_len and size.max_model_len > cfg.context + 2 * cfg.rounds * (cfg.steps + 1)
    assert size.decode_max_tokens == size.max_model_len - cfg.context
    assert size.num_blocks * cfg.block_size >= 8 * size.max_model_len + 2 * cfg.prompt_len
    assert cfg.num_seqs == 64 and LoopBenchConfig(batches=(70,), token_budget=128).num_seqs == 72
    with pytest.raises(ValueError, match="token_budget"):
        LoopBenchConfig(batches=(32,), token_budget=32)
