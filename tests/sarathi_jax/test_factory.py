"""`sarathi_jax.factory`: the simulated engine is sized like the LLMEngine the same config builds (KV blocks from
the model's shape, max_model_len, scheduler limits, token budget: one sequence, `token_budget.plan_engine`), and a
calibrated cost model pads to that engine's token buckets."""

from __future__ import annotations

from sarathi_jax.factory import build_simulated_engine
from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.sim.cost_model import BucketCostModel
from sarathi_jax.models.presets import get_preset
from sarathi_jax.sim.simulator import CostModel
from sarathi_jax.config.sizing import kv_bytes_per_block


def test_sized_like_the_real_engine():
    per_block = kv_bytes_per_block(get_preset("tiny-llama"), 16, "float32")
    config = EngineConfig(model="tiny-llama", dtype="float32", scheduler="sarathi", token_budget=96,
                          max_num_seqs=8, max_model_len=512, kv_cache_bytes=100 * per_block)
    engine = build_simulated_engine(config)
    assert engine.block_manager.num_total_blocks == 100  # kv_cache_bytes over tiny-llama's bytes per block
    assert engine.max_model_len == 512
    sc = engine.scheduler_config
    assert (sc.policy, sc.token_budget, sc.max_num_seqs) == ("sarathi", 96, 8)
    assert isinstance(engine.cost_model, CostModel)  # the simulator's default
    small = build_simulated_engine(EngineConfig(model="tiny-llama", dtype="float32", num_blocks=10))
    assert small.block_manager.num_total_blocks == 10 and small.max_model_len == 160  # capped by the cache


def test_a_bucket_cost_model_gets_the_engines_buckets():
    measured = BucketCostModel({16: 0.01, 32: 0.02}, 0.0, 0.0)
    config = EngineConfig(model="tiny-llama", dtype="float32", scheduler="sarathi", token_budget=96, num_blocks=64)
    engine = build_simulated_engine(config, measured)
    assert engine.cost_model.buckets == (16, 32, 64, 96)  # the runner's buckets for a budget of 96
    assert engine.cost_model.padded(70) == 96 and measured.padded(70) == 70  # the measured one is unchanged
    assert build_simulated_engine(config, CostModel(overhead_s=1.0)).cost_model == CostModel(overhead_s=1.0)
    # Calibrated on a CPU (its source says so), it pads like a CPU engine: 4, 8, then 1.5x mid buckets.
    on_cpu = BucketCostModel({4: 0.005, 16: 0.01, 32: 0.02}, 0.0, 0.0, source={"platform": "cpu"})
    buckets = build_simulated_engine(config, on_cpu).cost_model.buckets
    assert buckets[:3] == (4, 8, 16) and 24 in buckets and buckets[-1] == 96


def test_tensor_parallel_and_disaggregated_engines_get_n_devices_kv_and_scaled_costs():
    import pytest

    from sarathi_jax.sim.tp_cost import TensorParallelCost

    per_block = kv_bytes_per_block(get_preset("llama-50m"), 16, "float32")
    kw = dict(model="llama-50m", dtype="float32", scheduler="sarathi", token_budget=64, max_num_seqs=8,
              max_model_len=512, kv_cache_bytes=100 * per_block)
    tp2 = build_simulated_engine(EngineConfig(**kw, tensor_parallel_size=2), CostModel())
    assert tp2.block_manager.num_total_blocks == 200  # two devices' KV
    assert isinstance(tp2.cost_model, TensorParallelCost) and tp2.cost_model.tp == 2
    split = build_simulated_engine(EngineConfig(**kw, disaggregation="1:2/1"), CostModel(), num_devices=4)
    assert [(i.name, i.block_manager.num_total_blocks) for i in split.instances] == [
        ("prefill0", 100), ("decode0", 100), ("decode1", 100)]
    assert split.kv_bytes_per_token == per_block // 16
    with pytest.raises(ValueError, match="tensor parallelism 3 does not divide the model's 8 attention heads"):
        build_simulated_engine(EngineConfig(**kw, disaggregation="1:3"), CostModel())
    with pytest.raises(ValueError, match="needs 4 devices .* only 2"):
        build_simulated_engine(EngineConfig(**kw, disaggregation="2:2"), CostModel(), num_devices=2)


def test_the_real_and_the_simulated_engine_are_sized_and_budgeted_alike():
    from sarathi_jax.factory import build_engine

    per_block = kv_bytes_per_block(get_preset("tiny-llama"), 16, "float32")
    config = EngineConfig(model="tiny-llama", dtype="float32", scheduler="sarathi", token_budget=48,
                          max_num_seqs=4, max_model_len=256, kv_cache_bytes=40 * per_block)
    real, simulated = build_engine(config, warmup=False), build_simulated_engine(config)
    assert real.block_manager.num_total_blocks == simulated.block_manager.num_total_blocks == 40
    assert real.max_model_len == simulated.max_model_len == 256
    assert real.scheduler_config == simulated.scheduler_config
    assert real.budget_setup == simulated.budget_setup and real.budget_setup.describe() == "token budget 48"


def test_auto_and_dynamic_budgets_resolve_through_the_plan():
    from sarathi_jax.engine.token_budget import plan_engine

    mc = get_preset("tiny-llama")
    measured = BucketCostModel({16: 0.001, 64: 0.004, 256: 0.016}, 0.0, 0.0)
    asked = []

    def predictor_for(buckets):
        asked.append(buckets)
        return measured, "measured"

    kw = dict(model="tiny-llama", dtype="float32", scheduler="sarathi", max_num_seqs=4, num_blocks=64,
              slo_tbt_s=0.005, max_token_budget=256)
    auto = plan_engine(EngineConfig(**kw, token_budget="auto"), mc, None, "gpu", predictor_for)
    assert isinstance(auto.config.token_budget, int) and auto.budget_setup.mode == "auto"
    assert auto.sizing.scheduler_config.token_budget == auto.config.token_budget < 256
    dynamic = plan_engine(EngineConfig(**kw, token_budget="dynamic"), mc, None, "gpu", predictor_for)
    assert dynamic.config.token_budget == 256 and dynamic.budget_setup.policy is not None
    assert all(b[-1] == 256 for b in asked)  # both asked with the buckets of the engine at the ceiling
    pending = plan_engine(EngineConfig(**kw, token_budget="auto"), mc, None, "gpu", lambda b: (None, None))
    assert pending.budget_setup is None and pending.config.token_budget == 256  # sized at the ceiling
    sim = build_simulated_engine(EngineConfig(**kw, token_budget="auto"), measured)
    assert sim.budget_setup.budget == auto.budget_setup.budget
