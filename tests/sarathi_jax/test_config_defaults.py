"""Defaults that adapt to explicit choices (never contradict them), `attention_backend="auto"`, and the engine's
start-up report."""

from __future__ import annotations

import jax
import pytest

from pallas_kernels import get_attention_fn
from sarathi_jax import LLM, EngineConfig
from sarathi_jax.config import resolve_attention_backend
from sarathi_jax.engine import format_startup
from sarathi_jax.models.presets import get_preset
from sarathi_jax.sizing import size_engine


def test_max_num_seqs_default_is_capped_by_the_token_budget():
    assert (EngineConfig().token_budget, EngineConfig().max_num_seqs) == (512, 128)
    assert EngineConfig(token_budget=64).max_num_seqs == 64
    assert EngineConfig(token_budget=256).max_num_seqs == 128
    # Whole-prompt policies: capped by an explicit max_num_batched_tokens, their batch limit.
    assert EngineConfig(scheduler="vllm", max_num_batched_tokens=64).max_num_seqs == 64


def test_explicit_contradictions_are_still_refused():
    with pytest.raises(ValueError, match=r"token_budget \(64\) must be >= max_num_seqs \(128\)"):
        EngineConfig(token_budget=64, max_num_seqs=128)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be >= max_num_seqs \(128\)"):
        EngineConfig(scheduler="vllm", max_num_batched_tokens=64, max_num_seqs=128)


def test_token_budget_default_makes_room_for_an_explicit_max_num_seqs():
    assert EngineConfig(max_num_seqs=1000).token_budget == 1008  # a multiple of 16 (the smallest bucket)
    assert EngineConfig(max_num_seqs=8).token_budget == 512


def test_whole_prompt_max_model_len_default_respects_an_explicit_batch_limit():
    mc = get_preset("tiny-llama")
    config = EngineConfig(scheduler="vllm", max_num_batched_tokens=256, num_blocks=1024)
    assert 256 < mc.max_model_len
    assert size_engine(config, mc).max_model_len == 256
    with pytest.raises(ValueError, match="must be >= max_model_len"):  # an explicit contradiction: refused
        size_engine(EngineConfig(scheduler="vllm", max_num_batched_tokens=256, max_model_len=512), mc)


@pytest.mark.parametrize(
    "name, platform, expected",
    [("auto", "gpu", "pallas"), ("auto", "cuda", "pallas"), ("auto", "rocm", "pallas"), ("auto", "cpu", "xla"),
     ("auto", "tpu", "xla"), ("xla", "gpu", "xla"), ("pallas", "cpu", "pallas")],
)
def test_auto_attention_backend_picks_by_platform(name, platform, expected):
    assert resolve_attention_backend(name, platform) == expected


def test_attention_backend_names_are_checked():
    assert EngineConfig().attention_backend == "auto"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="triton")
    with pytest.raises(ValueError, match="unknown attention backend"):  # the engine resolves "auto" first
        get_attention_fn("auto")


def test_llm_with_only_a_small_token_budget_builds_and_reports_its_start_up():
    llm = LLM("tiny-llama", token_budget=64, num_blocks=16, max_model_len=128, warmup=False)
    engine = llm.engine
    assert engine.config.max_num_seqs == 64 and engine.scheduler_config.max_num_seqs == 64
    backend = resolve_attention_backend("auto", jax.default_backend())  # xla on CPU, pallas on GPU
    assert engine.config.attention_backend == backend
    stats = engine.startup_stats()
    for key in ("load_s", "init_s", "compile_s", "warmup_s", "total_s"):
        assert stats[key] >= 0, key
    parts = stats["load_s"] + stats["init_s"] + stats["compile_s"] + stats["warmup_s"]
    assert parts <= stats["total_s"] + 1e-6
    assert stats["platform"] == jax.default_backend() and stats["attention_backend"] == backend
    assert stats["attention_backend_setting"] == "auto" and stats["warmed_up"] is False
    line = format_startup(stats)
    assert line.startswith("engine ready in") and f"{backend} (auto) attention" in line
    assert stats["platform"] in line and stats["device"] in line
