"""Defaults that adapt to explicit choices (never contradict them), `attention_backend="auto"`, `dtype="auto"`,
KV sizing from device memory (mocked: no GPU needed), the `cuda` extra, and the engine's start-up report."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import jax
import pytest
from packaging.requirements import Requirement

from pallas_kernels import cpu_kernel_status, get_attention_fn
from sarathi_jax import LLM, EngineConfig
from sarathi_jax.engine import llm_engine as engine_module
from sarathi_jax.bench.__main__ import default_model
from sarathi_jax.config.engine_config import DEFAULT_KV_CACHE_BYTES, resolve_attention_backend, resolve_dtype
from sarathi_jax.engine.llm_engine import format_startup
from sarathi_jax.models.presets import CPU_PRESETS, PRESETS, get_preset
from sarathi_jax.config.sizing import (
    LARGEST_BLOCK_FRACTION,
    activation_bytes_estimate,
    jax_mem_fraction,
    kv_bytes_per_block,
    kv_cache_budget,
    size_engine,
)

GiB = 1 << 30


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
    [("auto", "gpu", "pallas"), ("auto", "cuda", "pallas"), ("auto", "rocm", "pallas"), ("auto", "cpu", "cpu"),
     ("auto", "tpu", "xla"), ("xla", "gpu", "xla"), ("pallas", "cpu", "pallas"), ("cpu", "cpu", "cpu"),
     ("xla", "cpu", "xla")],
)
def test_auto_attention_backend_picks_by_platform(name, platform, expected):
    assert resolve_attention_backend(name, platform, cpu_kernel_status=None) == expected


def test_without_the_cpu_kernel_auto_falls_back_to_jnp_and_cpu_is_refused():
    why = "the CPU attention kernel was not built"
    assert resolve_attention_backend("auto", "cpu", cpu_kernel_status=why) == "xla"
    with pytest.raises(ValueError, match="not available: the CPU attention kernel was not built"):
        resolve_attention_backend("cpu", "cpu", cpu_kernel_status=why)
    with pytest.raises(ValueError, match="runs on 'gpu'"):
        resolve_attention_backend("cpu", "gpu", cpu_kernel_status=None)


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
    # cpu (where the kernel is built) on a CPU, pallas on a GPU
    backend = resolve_attention_backend("auto", jax.default_backend(), cpu_kernel_status=cpu_kernel_status())
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
    dtype = resolve_dtype("auto", jax.default_backend())
    assert engine.config.dtype == stats["dtype"] == dtype and stats["dtype_setting"] == "auto"
    assert f"{dtype} (auto)" in line and "KV cache 16 blocks" in line
    assert stats["num_kv_blocks"] == 16 and stats["gpu_memory_utilization"] is None


# ----------------------------------------------------------------------------------- the GPU user's path


def test_cuda_extra_names_a_cuda_extra_that_the_installed_jax_declares():
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    jax_extras = set(importlib.metadata.metadata("jax").get_all("Provides-Extra") or ())
    for name in ("cuda", "cuda12"):
        (requirement,) = [Requirement(r) for r in extras[name]]
        assert requirement.name == "jax" and len(requirement.extras) == 1, requirement
        (extra,) = requirement.extras
        assert extra.startswith("cuda") and extra in jax_extras, (extra, sorted(jax_extras))
    assert Requirement(extras["cuda"][0]).extras == {"cuda13"}  # JAX's installation guide leads with CUDA 13


@pytest.mark.parametrize(
    "name, platform, expected",
    [("auto", "gpu", "bfloat16"), ("auto", "cuda", "bfloat16"), ("auto", "rocm", "bfloat16"),
     ("auto", "tpu", "bfloat16"), ("auto", "cpu", "float32"), ("float32", "gpu", "float32"),
     ("bfloat16", "cpu", "bfloat16")],
)
def test_auto_dtype_picks_by_platform(name, platform, expected):
    assert resolve_dtype(name, platform) == expected


def test_dtype_default_is_auto_and_names_are_checked():
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="float16")


@pytest.mark.parametrize("platform, expected", [("gpu", "llama-1b"), ("cuda", "llama-1b"), ("cpu", "tiny-llama")])
def test_bench_default_model_by_platform(platform, expected):
    assert default_model(platform) == expected
    assert (expected in CPU_PRESETS) == (platform == "cpu") and expected in PRESETS


def test_kv_sizings_are_one_at_a_time():
    for kw in ({"num_blocks": 8, "kv_cache_bytes": GiB}, {"num_blocks": 8, "gpu_memory_utilization": 0.5},
               {"kv_cache_bytes": GiB, "gpu_memory_utilization": 0.5}):
        with pytest.raises(ValueError, match="each size the KV cache: give one of them"):
            EngineConfig(**kw)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            EngineConfig(gpu_memory_utilization=bad)


def _stats(limit: int, in_use: int) -> dict:
    return {"bytes_limit": limit, "bytes_in_use": in_use, "peak_bytes_in_use": in_use}


def test_kv_budget_from_mocked_gpu_memory():
    mc = get_preset("mistral-7b")
    config = EngineConfig(model="mistral-7b")
    act = activation_bytes_estimate(config, mc)
    # An 80 GiB GPU under JAX's default allocator (75%: a 60 GiB bytes_limit), 14 GiB of bf16 weights in use.
    gpu = [_stats(60 * GiB, 14 * GiB)]
    budget = kv_cache_budget(config, mc, gpu, mem_fraction=0.75)
    # The default 0.9 is lowered to 0.9 of the allocator's 0.75 (a tenth of the pool stays free for XLA's
    # autotuning): 54 GiB usable, not 72 or 60.
    assert budget.gpu_memory_utilization == pytest.approx(0.675)
    assert budget.kv_cache_bytes == 54 * GiB - 14 * GiB - act and budget.activation_bytes == act
    half = kv_cache_budget(EngineConfig(gpu_memory_utilization=0.5), mc, gpu, mem_fraction=0.75)
    assert half.kv_cache_bytes == 40 * GiB - 14 * GiB - act  # half of the device's 80 GiB
    # Under XLA_CLIENT_MEM_FRACTION=1.0 (an 80 GiB limit) vLLM's default 0.9 holds: 72 GiB.
    roomy = kv_cache_budget(config, mc, [_stats(80 * GiB, 14 * GiB)], mem_fraction=1.0)
    assert roomy.gpu_memory_utilization == 0.9 and roomy.kv_cache_bytes == 72 * GiB - 14 * GiB - act
    # Two devices (tensor parallel): each holds half of every block; the tighter device decides.
    tp2 = EngineConfig(model="mistral-7b", tensor_parallel_size=2)
    two = kv_cache_budget(tp2, mc, [_stats(60 * GiB, 7 * GiB), _stats(60 * GiB, 8 * GiB)], 0.75)
    assert two.kv_cache_bytes == 2 * (54 * GiB - 8 * GiB - act)
    # 16-way tensor parallel over 8 KV heads: each head is replicated on two devices, so 8 shares, not 16.
    tp16 = EngineConfig(model="mistral-7b", tensor_parallel_size=16)
    assert mc.num_key_value_heads == 8
    assert kv_cache_budget(tp16, mc, [_stats(60 * GiB, 8 * GiB)] * 16, 0.75).kv_cache_bytes == 8 * (46 * GiB - act)
    # Two pipeline stages of two devices: four shares.
    pp2 = EngineConfig(model="mistral-7b", tensor_parallel_size=2, pipeline_parallel_size=2)
    assert kv_cache_budget(pp2, mc, [_stats(60 * GiB, 8 * GiB)] * 4, 0.75).kv_cache_bytes == 4 * (46 * GiB - act)
    # The budget becomes blocks of bfloat16 KV (dtype "auto" on a GPU).
    sized = size_engine(config, mc, budget.kv_cache_bytes, platform="gpu")
    assert sized.num_blocks == budget.kv_cache_bytes // kv_bytes_per_block(mc, 16, "bfloat16")


def test_kv_budget_fits_the_largest_free_block():
    """K and V are one allocation each: a pool with enough free memory in all but no block to hold them both
    gets a cache that fits the block (as measured on an H100 after mistral-7b's load: 45 GiB free, the
    largest block 32 GiB), and says by how much it was cut."""
    mc = get_preset("mistral-7b")
    config = EngineConfig(model="mistral-7b")
    act = activation_bytes_estimate(config, mc)
    whole = {**_stats(60 * GiB, 14 * GiB), "largest_free_block_bytes": 46 * GiB}
    assert kv_cache_budget(config, mc, [whole], 0.75).unfragmented_bytes is None  # the fraction decides
    holed = {**_stats(60 * GiB, 14 * GiB), "largest_free_block_bytes": 32 * GiB}
    cut = kv_cache_budget(config, mc, [holed], 0.75)
    assert cut.kv_cache_bytes == int(LARGEST_BLOCK_FRACTION * 32 * GiB) - act
    assert cut.unfragmented_bytes == 54 * GiB - 14 * GiB - act
    # With tensor parallelism the most fragmented device decides every device's share.
    tp2 = EngineConfig(model="mistral-7b", tensor_parallel_size=2)
    two = kv_cache_budget(tp2, mc, [{**_stats(60 * GiB, 7 * GiB), "largest_free_block_bytes": 20 * GiB},
                                    {**_stats(60 * GiB, 7 * GiB), "largest_free_block_bytes": 50 * GiB}], 0.75)
    assert two.kv_cache_bytes == 2 * (int(LARGEST_BLOCK_FRACTION * 20 * GiB) - act)
    # Without preallocation the pool starts small: the room it may still grow by is one block too.
    growing = {**_stats(60 * GiB, 14 * GiB), "largest_free_block_bytes": GiB, "pool_bytes": 15 * GiB}
    assert kv_cache_budget(config, mc, [growing], 0.75).unfragmented_bytes is None
    preallocated = {**holed, "pool_bytes": 60 * GiB}
    assert kv_cache_budget(config, mc, [preallocated], 0.75).kv_cache_bytes == cut.kv_cache_bytes
    with pytest.raises(ValueError, match="no free block of device memory holds it"):
        kv_cache_budget(config, mc, [{**_stats(60 * GiB, 14 * GiB), "largest_free_block_bytes": act // 2}], 0.75)


def test_kv_budget_explicit_values_and_refusals():
    mc = get_preset("mistral-7b")
    gpu = [_stats(60 * GiB, 14 * GiB)]
    assert kv_cache_budget(EngineConfig(num_blocks=100), mc, gpu, 0.75) is None  # num_blocks: used as given
    fixed = kv_cache_budget(EngineConfig(kv_cache_bytes=3 * GiB), mc, gpu, 0.75)
    assert (fixed.kv_cache_bytes, fixed.gpu_memory_utilization) == (3 * GiB, None)
    cpu = kv_cache_budget(EngineConfig(), mc, [None], 0.75)  # a CPU reports no memory: the fixed budget
    assert (cpu.kv_cache_bytes, cpu.gpu_memory_utilization) == (DEFAULT_KV_CACHE_BYTES, None)
    with pytest.raises(ValueError, match="do not report their memory"):
        kv_cache_budget(EngineConfig(gpu_memory_utilization=0.5), mc, [None], 0.75)
    with pytest.raises(ValueError, match="XLA_CLIENT_MEM_FRACTION=0.9"):  # more than JAX's allocator may use
        kv_cache_budget(EngineConfig(gpu_memory_utilization=0.9), mc, gpu, 0.75)
    with pytest.raises(ValueError, match="leaves no memory for the KV cache"):
        kv_cache_budget(EngineConfig(gpu_memory_utilization=0.18), mc, gpu, 0.75)  # 14.4 GiB < 14 GiB + activations


def test_activation_estimate_grows_with_the_batch():
    mc = get_preset("mistral-7b")
    small = activation_bytes_estimate(EngineConfig(token_budget=512), mc)
    large = activation_bytes_estimate(EngineConfig(token_budget=2048), mc)
    whole = activation_bytes_estimate(EngineConfig(scheduler="vllm", token_budget=512, max_model_len=4096), mc)
    assert small < large < whole  # whole-prompt policies batch up to a full prompt


def test_jax_mem_fraction_from_the_environment():
    assert jax_mem_fraction({}) == 0.75
    assert jax_mem_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"}) == 0.9
    assert jax_mem_fraction({"XLA_CLIENT_MEM_FRACTION": "0.5", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"}) == 0.5


def test_engine_sizes_its_kv_cache_from_mocked_device_memory(monkeypatch):
    # The engine's wiring, on this CPU: pretend the device reports its memory.
    mc = get_preset("tiny-llama")
    per_block = kv_bytes_per_block(mc, 16, resolve_dtype("auto", jax.default_backend()))
    fraction = jax_mem_fraction() if jax.default_backend() == "gpu" else 1.0
    act = activation_bytes_estimate(EngineConfig(token_budget=64, max_model_len=128), mc)
    limit = 2 * GiB
    in_use = int(0.8 * limit / fraction) - act - (32 << 20)  # leaves 32 MiB for the KV cache
    monkeypatch.setattr(engine_module, "_memory_stats", lambda devices: [_stats(limit, in_use)] * len(devices))
    llm = LLM("tiny-llama", token_budget=64, max_model_len=128, gpu_memory_utilization=0.8, warmup=False)
    engine = llm.engine
    expected = (32 << 20) // per_block
    assert engine.block_manager.num_total_blocks == expected > 0
    stats = engine.startup_stats()
    assert stats["num_kv_blocks"] == expected and stats["gpu_memory_utilization"] == 0.8
    assert stats["peak_bytes_in_use"] == in_use and engine.config.gpu_memory_utilization == 0.8
    assert "gpu_memory_utilization 0.8" in format_startup(stats)


def test_unrolled_weights_are_unstacked_before_the_kv_cache_is_sized(monkeypatch):
    # Unrolling copies every layer's weights out of the stacked arrays. On an H100 that copy, made after the
    # KV cache had been sized from the free memory, held mistral-7b's weights twice and ran out of memory in
    # warm-up. The device's memory must be read with the per-layer weights alone in place.
    events = []
    real_unstack = engine_module.unstack_layer_params
    monkeypatch.setattr(engine_module, "unstack_layer_params", lambda p: events.append("unstack") or real_unstack(p))
    monkeypatch.setattr(engine_module, "_memory_stats", lambda devices: events.append("memory") or [None] * len(devices))
    llm = LLM("tiny-llama", token_budget=64, max_model_len=128, scan_layers=False, warmup=False)
    assert events.index("unstack") < events.index("memory")
    params = llm.engine.runner.stages[0].params
    assert "layers" not in params and "layers_0" in params
    assert all(not k.startswith("layers") or k.startswith("layers_") for k in params)


def test_cli_flags_reach_the_engine_config():
    from sarathi_jax.bench.__main__ import build_parser as bench_parser
    from sarathi_jax.bench.__main__ import engine_config_kwargs
    from server.__main__ import build_parser as server_parser
    from server.__main__ import engine_config_from_args

    config = engine_config_from_args(server_parser().parse_args(["--dtype", "auto", "--gpu-memory-utilization", "0.5"]))
    assert (config.dtype, config.gpu_memory_utilization, config.kv_cache_bytes) == ("auto", 0.5, None)
    with pytest.raises(ValueError, match="give one of them"):
        engine_config_from_args(server_parser().parse_args(["--kv-cache-bytes", "1000", "--gpu-memory-utilization", ".5"]))
    args = bench_parser().parse_args(["--model", "llama-1b", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.6"])
    kw = engine_config_kwargs(args, {"scheduler": "sarathi", "token_budget": 512})
    assert (kw["dtype"], kw["gpu_memory_utilization"]) == ("bfloat16", 0.6) and "kv_cache_bytes" not in kw
    assert bench_parser().parse_args([]).model is None  # chosen by platform at run time (default_model)
