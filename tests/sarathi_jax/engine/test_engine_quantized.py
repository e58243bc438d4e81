"""int8 weights end to end, against HF transformers: a float32 engine with quantization="int8" on a checkpoint
generates, greedy, exactly what HF's float32 forward generates on the same checkpoint with its decoder layers'
Linear weights replaced by their W8A16-dequantized copies, computed here in torch (per output row: scale =
max|w| / 127, q = round half to even(w / scale), w = q * scale). Every runner layout (in-major, out-major,
panels), the overlapped and synchronous loops, tensor parallelism, speculative decoding and prefix caching;
Llama (GQA, sharded safetensors), Qwen2 (biases) and Falcon (fused query_key_value, biases, parallel
attention)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.engine.llm_engine import format_startup
from sarathi_jax.models.out_major import IN_MAJOR, OUT_MAJOR, PANELS
from sarathi_jax.runner import model_runner
from tests.sarathi_jax.engine_helpers import hf_generate, run_staggered

PROMPT_LENGTHS = (1, 9, 33, 70, 130)  # ragged, crossing blocks and the token budget
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# The decoder layers' Linear modules, by name (HF's lm_head and embeddings stay float).
LAYER_MARKERS = (".layers.", ".h.")


def dequantized_copy(src: Path, dst: Path) -> Path:
    """`src` saved to `dst` with every decoder-layer Linear weight replaced by its int8 round trip, in torch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    replaced = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and any(m in name for m in LAYER_MARKERS):
                w = module.weight  # [out, in]
                scale = w.abs().amax(dim=1, keepdim=True) / 127
                module.weight.copy_(torch.round(w / scale).clamp(-127, 127) * scale)
                replaced += 1
    assert replaced >= 8  # 2 layers of 4+ projections: the names above matched
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def oracle(hf_checkpoint, falcon_checkpoint, tmp_path_factory):
    """`name -> (folder, prompts, HF's greedy tokens on the dequantized copy)`, each computed once."""
    cache: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}

    def get(name: str):
        if name not in cache:
            folder = falcon_checkpoint(name) if name.startswith("falcon") else hf_checkpoint(name)
            rng = np.random.default_rng(7)
            prompts = [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENGTHS]
            deq = dequantized_copy(folder, tmp_path_factory.mktemp(f"deq-{name}"))
            cache[name] = (folder, prompts, hf_generate(deq, prompts, MAX_TOKENS))
        return cache[name]

    return get


def make_engine(model_dir, **overrides) -> LLMEngine:
    fields = dict(model=str(model_dir), dtype="float32", quantization="int8", token_budget=64, max_num_seqs=8,
                  block_size=16, num_blocks=128, max_model_len=256, compilation_cache_dir=None)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields), warmup=False)


def in_layout(monkeypatch, layout: str) -> None:
    """Runners built from here on store their projections in `layout`."""
    if layout == PANELS:
        from pallas_kernels.panel_matmul_cpu import int8_matmul_status

        assert int8_matmul_status() is None, int8_matmul_status()  # the kernel is built: fail, never skip
    monkeypatch.setattr(model_runner, "projection_layout", lambda *a, **k: layout)


def check(engine: LLMEngine, prompts, expected, arrive_every: int = 2) -> None:
    finished = run_staggered(engine, prompts, GREEDY, arrive_every=arrive_every)
    for i, want in enumerate(expected):
        assert finished[f"r{i}"] == want, f"prompt {i} (length {len(prompts[i])}) diverged"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


@pytest.mark.parametrize("layout", [IN_MAJOR, OUT_MAJOR, PANELS])
@pytest.mark.parametrize("name", ["llama", "qwen2", "falcon-new", "falcon-7b"])
def test_int8_greedy_matches_hf_on_dequantized_weights(oracle, monkeypatch, name, layout):
    folder, prompts, expected = oracle(name)
    in_layout(monkeypatch, layout)
    engine = make_engine(folder)
    assert engine.model_config.quantization == "int8" and engine.runner.model.projection_layout == layout
    check(engine, prompts, expected)
    # Chunked prefills mixed with decodes really happened.
    assert any(r.num_decode_tokens and r.num_prefill_tokens for r in engine.iteration_log)


@pytest.mark.parametrize("name", ["llama", "falcon-new"])
def test_int8_synchronous_loop_and_small_budget(oracle, name):
    folder, prompts, expected = oracle(name)
    check(make_engine(folder, async_scheduling=False, token_budget=32), prompts, expected, arrive_every=3)


@pytest.mark.parametrize("name", ["llama", "qwen2", "falcon-new"])
def test_int8_tensor_parallel_matches_hf(oracle, name):
    folder, prompts, expected = oracle(name)
    engine = make_engine(folder, tensor_parallel_size=2)
    int8 = [x for x in jax.tree.leaves(engine.runner.params) if x.dtype == np.int8]
    assert len(int8) >= 4 and all(len(x.sharding.device_set) == 2 for x in int8)
    check(engine, prompts, expected)


def test_int8_with_speculation_and_prefix_caching(oracle):
    folder, prompts, expected = oracle("llama")
    spec = {"method": "self", "num_layers": 1, "num_speculative_tokens": 2}
    engine = make_engine(folder, speculative_config=spec)
    check(engine, prompts, expected)
    # The same prompts again: their prefixes come from the cache, the tokens do not change.
    hits = engine.block_manager.num_prefix_hits
    check(engine, prompts, expected)
    assert engine.block_manager.num_prefix_hits > hits


def test_weight_bytes_and_the_ready_line(hf_checkpoint):
    folder = hf_checkpoint("llama")
    float_stats = make_engine(folder, quantization=None).startup_stats()
    int8_engine = make_engine(folder)
    stats = int8_engine.startup_stats()
    assert float_stats["quantization"] is None and stats["quantization"] == "int8"
    leaves = jax.tree.leaves(int8_engine.runner.params)
    assert stats["weight_bytes"] == sum(x.nbytes for x in leaves)
    assert stats["weight_bytes"] < float_stats["weight_bytes"]
    assert "int8 weights" in format_startup(stats) and "int8" not in format_startup(float_stats)


def test_int8_weights_take_a_third_of_float32s_where_layers_dominate(tmp_path):
    from tests.conftest import write_hf_checkpoint

    # Layers hold ~95% of the parameters: a small vocabulary, a wide MLP.
    folder = write_hf_checkpoint(tmp_path / "wide", "LlamaForCausalLM", dict(
        vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True), seed=0)
    sizes = {q: make_engine(folder, quantization=q).startup_stats()["weight_bytes"] for q in (None, "int8")}
    assert sizes["int8"] <= 0.35 * sizes[None], sizes


def test_int8_pipeline_parallel_matches_hf(oracle):
    folder, prompts, expected = oracle("llama")
    check(make_engine(folder, tensor_parallel_size=2, pipeline_parallel_size=2), prompts, expected)


def test_int8_disaggregated_matches_hf(oracle):
    from sarathi_jax import LLM

    folder, prompts, expected = oracle("qwen2")
    llm = LLM(str(folder), warmup=False, disaggregation="1:1", dtype="float32", quantization="int8",
              token_budget=64, max_num_seqs=8, block_size=16, num_blocks=128, max_model_len=256,
              compilation_cache_dir=None)
    outs = llm.generate(prompts, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    assert all(i.engine.model_config.quantization == "int8" for i in llm.engine.instances)


def test_int8_bfloat16_engine_runs_close_to_float32(oracle):
    folder, prompts, expected = oracle("llama")
    engine = make_engine(folder, dtype="bfloat16")
    finished = run_staggered(engine, prompts, GREEDY)
    # bfloat16 activations: not the float32 oracle's rounding, but the first tokens agree.
    assert sum(finished[f"r{i}"][0] == want[0] for i, want in enumerate(expected)) >= len(expected) - 1


def test_int8_draft_model_is_quantized_alike(oracle):
    folder, prompts, expected = oracle("llama")
    # The target as its own draft: every proposal is the target's continuation, and both hold int8 weights.
    engine = make_engine(folder, speculative_config={"model": str(folder), "num_speculative_tokens": 3})
    draft_params = engine.draft_runner.stage.params
    assert any(x.dtype == np.int8 for x in jax.tree.leaves(draft_params))
    check(engine, prompts, expected)


def test_int8_from_a_float_converted_folder_under_tensor_parallelism(oracle, tmp_path):
    from checkpoints_convert import convert

    folder, prompts, expected = oracle("llama")
    convert(folder, tmp_path / "orbax", "float32", log=lambda message: None)
    engine = make_engine(tmp_path / "orbax", tensor_parallel_size=2)  # each kernel restored sharded, then quantized
    assert engine.model_config.quantization == "int8"
    check(engine, prompts, expected)
