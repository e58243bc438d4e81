"""`bench.engines.make_simulated_engine`: the simulated engine is sized like the LLMEngine the same config would
build (KV blocks from the model's shape, max_model_len, scheduler limits), and a calibrated cost model pads to
that engine's token buckets."""

from __future__ import annotations

from sarathi_jax.factory import make_simulated_engine
from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.sim.cost_model import BucketCostModel
from sarathi_jax.models.presets import get_preset
from sarathi_jax.sim.simulator import CostModel
from sarathi_jax.config.sizing import kv_bytes_per_block


def test_sized_like_the_real_engine():
    per_block = kv_bytes_per_block(get_preset("tiny-llama"), 16, "float32")
    config = EngineConfig(model="tiny-llama", dtype="float32", scheduler="sarathi", token_budget=96,
                          max_num_seqs=8, max_model_len=512, kv_cache_bytes=100 * per_block)
    engine = make_simulated_engine(config)
    assert engine.block_manager.num_total_blocks == 100  # kv_cache_bytes over tiny-llama's bytes per block
    assert engine.max_model_len == 512
    sc = engine.scheduler_config
    assert (sc.policy, sc.token_budget, sc.max_num_seqs) == ("sarathi", 96, 8)
    assert isinstance(engine.cost_model, CostModel)  # the simulator's default
    small = make_simulated_engine(EngineConfig(model="tiny-llama", dtype="float32", num_blocks=10))
    assert small.block_manager.num_total_blocks == 10 and small.max_model_len == 160  # capped by the cache


def test_a_bucket_cost_model_gets_the_engines_buckets():
    measured = BucketCostModel({16: 0.01, 32: 0.02}, 0.0, 0.0)
    config = EngineConfig(model="tiny-llama", dtype="float32", scheduler="sarathi", token_budget=96, num_blocks=64)
    engine = make_simulated_engine(config, measured)
    assert engine.cost_model.buckets == (16, 32, 64, 96)  # the runner's buckets for a budget of 96
    assert engine.cost_model.padded(70) == 96 and measured.padded(70) == 70  # the measured one is unchanged
    assert make_simulated_engine(config, CostModel(overhead_s=1.0)).cost_model == CostModel(overhead_s=1.0)


def test_tensor_parallel_and_disaggregated_engines_get_n_devices_kv_and_scaled_costs():
    import pytest

    from sarathi_jax.factory import make_disaggregated_engine
    from sarathi_jax.sim.tp_cost import TensorParallelCost

    per_block = kv_bytes_per_block(get_preset("llama-50m"), 16, "float32")
    kw = dict(model="llama-50m", dtype="float32", scheduler="sarathi", token_budget=64, max_num_seqs=8,
              max_model_len=512, kv_cache_bytes=100 * per_block)
    tp2 = make_simulated_engine(EngineConfig(**kw, tensor_parallel_size=2), CostModel())
    assert tp2.block_manager.num_total_blocks == 200  # two devices' KV
    assert isinstance(tp2.cost_model, TensorParallelCost) and tp2.cost_model.tp == 2
    split = make_disaggregated_engine(EngineConfig(**kw, disaggregation="1:2/1"), CostModel(), num_devices=4)
    assert [(i.name, i.block_manager.num_total_blocks) for i in split.instances] == [
        ("prefill0", 100), ("decode0", 100), ("decode1", 100)]
    assert split.kv_bytes_per_token == per_block // 16
    with pytest.raises(ValueError, match="tensor parallelism 3 does not divide the model's 8 attention heads"):
        make_disaggregated_engine(EngineConfig(**kw, disaggregation="1:3"), CostModel())
    with pytest.raises(ValueError, match="needs 4 devices .* only 2"):
        make_disaggregated_engine(EngineConfig(**kw, disaggregation="2:2"), CostModel(), num_devices=2)
