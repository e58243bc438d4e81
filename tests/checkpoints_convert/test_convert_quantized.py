"""`python -m checkpoints_convert --quantization int8`: the decoder layers' projections written int8 with float32
per-output-channel scales, from an HF folder or a GGUF file.

- The converted folder's params equal `load_model(HF_DIR, quantization="int8")`'s exactly (int8 bit-identical,
  scales equal, every other leaf equal in its dtype), for Llama (float32 and bfloat16), Qwen2 and Falcon; the
  marker records the quantization and each leaf's real dtype.
- Its files on disk are much smaller than the float32 conversion's.
- It loads as int8 when no quantization is asked (`load_model`, the engine) and refuses fp8.
- The CLI: `--quantization` in --help, fp8 refused at conversion, `--verify` against transformers with its
  decoder Linears int8-dequantized in torch (and failing at threshold 0).
- A GGUF file converted with `--quantization int8` generates the same greedy tokens as its float conversion
  loaded with quantization="int8" (same float values, so the same q and scales).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints_convert import ConversionError, convert
from checkpoints_convert.__main__ import main
from checkpoints_convert.gguf_source import convert_gguf
from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.models import CheckpointError, ModelConfig, load_model
from sarathi_jax.models.loader import (
    CHECKPOINT_MARKER,
    ORBAX_PARAMS_DIR,
    load_model_config,
)
from tests.checkpoints_convert.test_gguf_synthetic import (
    SYNTHETIC_TYPES,
    _write_llama_gguf,
)

MODELS = ("llama", "qwen2", "falcon-new")
QUIET = {"log": lambda message: None}


@pytest.fixture(scope="module")
def hf_dir(hf_checkpoint, falcon_checkpoint):
    def get(name: str) -> Path:
        return falcon_checkpoint(name) if name.startswith("falcon") else hf_checkpoint(name)

    return get


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """(name, dtype, quantization) -> the folder converted from that HF folder (once per module)."""
    cache: dict[tuple[str, str, str | None], Path] = {}

    def get(name: str, dtype: str = "float32", quantization: str | None = "int8") -> Path:
        key = (name, dtype, quantization)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"orbax-{name}-{dtype}-{quantization}") / "ckpt"
            result = convert(hf_dir(name), out, dtype, quantization=quantization, **QUIET)
            assert result.config.quantization == quantization
            cache[key] = out
        return cache[key]

    return get


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in (folder / ORBAX_PARAMS_DIR).rglob("*") if p.is_file())


def flat(params: Any) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}


def run_engine(model_dir: Path, prompts: list[list[int]],
               quantization: str | None = None) -> tuple[list[list[int]], str | None]:
    """Greedy tokens of `prompts` through `LLMEngine`, and the quantization the engine serves."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), token_budget=64, max_num_seqs=8, num_blocks=64,
                                    max_model_len=256, quantization=quantization), warmup=False)
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return [done[f"r{i}"] for i in range(len(prompts))], engine.model_config.quantization


# ---------------------------------------------------------------------------------------------- HF folders


@pytest.mark.parametrize("name,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "float32"),
                                        ("falcon-new", "float32")])
def test_int8_folder_equals_load_time_quantization(converted, hf_dir, name, dtype):
    out = converted(name, dtype)
    marker = json.loads((out / CHECKPOINT_MARKER).read_text())
    assert marker["quantization"] == "int8" and marker["dtype"] == dtype
    kernels = {k: v for k, v in marker["params"].items() if k.startswith("layers/") and k.endswith("/kernel")}
    scales = {k: v for k, v in marker["params"].items() if k.endswith("/kernel_scale")}
    assert kernels and {k[: -len("kernel")] for k in kernels} == {k[: -len("kernel_scale")] for k in scales}
    assert all(v["dtype"] == "int8" for v in kernels.values()) and all(v["dtype"] == "float32" for v in scales.values())
    others = [v["dtype"] for k, v in marker["params"].items() if k not in kernels and k not in scales]
    assert others and set(others) == {dtype}

    config, restored = load_model(out, jnp.dtype(dtype))  # no quantization asked: the folder's own
    assert config.quantization == "int8"
    direct_config, direct = load_model(hf_dir(name), jnp.dtype(dtype), quantization="int8")
    assert config == direct_config
    restored, direct = flat(restored), flat(direct)
    assert restored.keys() == direct.keys() and any(k.endswith("['kernel_scale']") for k in restored)
    for key, leaf in restored.items():
        assert leaf.dtype == direct[key].dtype, key
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(direct[key]), err_msg=key)


def test_int8_folder_is_much_smaller(converted):
    float_bytes = disk_bytes(converted("llama", "float32", None))
    int8_bytes = disk_bytes(converted("llama", "float32", "int8"))
    marker = json.loads((converted("llama") / CHECKPOINT_MARKER).read_text())
    print(f"tiny llama on disk: float32 {float_bytes} B, int8 {int8_bytes} B ({int8_bytes / float_bytes:.2f}x)")
    # Projections are 295 KiB of the tiny model's 425 KiB in float32: int8 keeps a quarter of them.
    assert int8_bytes < 0.55 * float_bytes
    assert marker["num_bytes"] <= int8_bytes


def test_int8_folder_serves_int8_and_refuses_fp8(converted, hf_dir):
    out = converted("llama")
    assert load_model_config(out).quantization == "int8"
    assert load_model_config(out, "int8").quantization == "int8"
    with pytest.raises(CheckpointError, match=r"holds int8 weights.*cannot serve quantization='fp8'"):
        load_model(out, quantization="fp8")
    with pytest.raises(ValueError, match="fp8"):
        LLMEngine(EngineConfig(model=str(out), quantization="fp8", num_blocks=64, max_model_len=256), warmup=False)
    # The engine serves it as int8 without asking: the same greedy tokens as the HF folder quantized at load.
    prompts = [list(range(3, 3 + n)) for n in (5, 17)]
    tokens, quantization = run_engine(out, prompts)
    assert quantization == "int8"
    assert tokens == run_engine(hf_dir("llama"), prompts, "int8")[0]


def test_fp8_conversion_refused(hf_dir, tmp_path, capsys):
    with pytest.raises(ConversionError, match="chosen at load"):
        convert(hf_dir("llama"), tmp_path / "api", quantization="fp8", **QUIET)
    assert main(["--hf", str(hf_dir("llama")), "--out", str(tmp_path / "cli"), "--quantization", "fp8"]) == 2
    assert "fp8 weights run only on GPUs with FP8 matmul" in capsys.readouterr().err
    assert not (tmp_path / "api").exists() and not (tmp_path / "cli").exists()


def test_help_names_quantization(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--quantization {int8,fp8}" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["llama", "falcon-new"])
def test_cli_verify_against_dequantized_transformers(hf_dir, tmp_path, capsys, name):
    out = tmp_path / "verified"
    args = ["--hf", str(hf_dir(name)), "--out", str(out), "--quantization", "int8", "--dtype", "float32",
            "--verify", "--quiet"]
    assert main(args) == 0
    log = capsys.readouterr().out
    assert "vs transformers on int8-dequantized weights" in log and "OK" in log
    assert main(args + ["--force", "--verify-threshold", "0"]) == 3


def test_verify_reference_is_the_dequantized_model(hf_dir, converted):
    """Without the dequantized reference the int8 folder is measurably off transformers' float model (so the
    comparison above is not vacuous); with it, within float32 rounding."""
    from checkpoints_convert.verifier import engine_logits, hf_logits

    ids = list(range(3, 40))
    ours = engine_logits(converted("llama"), ids, "float32")
    rel = lambda ref: float(np.abs(ours - ref).max() / np.abs(ref).max())
    assert rel(hf_logits(hf_dir("llama"), ids, "int8")) <= 1e-4
    assert rel(hf_logits(hf_dir("llama"), ids)) > 1e-3


# ---------------------------------------------------------------------------------------------- GGUF


def test_gguf_int8_conversion_equals_float_conversion_quantized_at_load(hf_checkpoint, tmp_path, capsys):
    """The small synthetic GGUF (several quant types): its int8 conversion passes --verify (transformers' own GGUF
    loading, decoder Linears int8-dequantized), generates the tokens of its float32 conversion loaded with
    quantization="int8", and holds the same q and scales."""
    _write_llama_gguf(tmp_path / "tiny.gguf", hf_checkpoint("llama"), SYNTHETIC_TYPES)
    int8_dir, float_dir = tmp_path / "int8", tmp_path / "float"
    assert main(["--gguf", str(tmp_path / "tiny.gguf"), "--out", str(int8_dir), "--quantization", "int8",
                 "--verify", "--quiet"]) == 0
    log = capsys.readouterr().out
    assert "vs transformers on int8-dequantized weights" in log and "OK" in log
    convert_gguf(tmp_path / "tiny.gguf", float_dir, "float32", **QUIET)
    marker = json.loads((int8_dir / CHECKPOINT_MARKER).read_text())
    assert marker["quantization"] == "int8" and marker["dtype"] == "float32"
    assert ModelConfig.from_pretrained(int8_dir) == ModelConfig.from_pretrained(float_dir)
    print(f"tiny GGUF llama on disk: float32 {disk_bytes(float_dir)} B, int8 {disk_bytes(int8_dir)} B")

    _, from_int8 = load_model(int8_dir)
    _, from_float = load_model(float_dir, quantization="int8")
    from_int8, from_float = flat(from_int8), flat(from_float)
    assert from_int8.keys() == from_float.keys()
    for key, leaf in from_int8.items():
        assert leaf.dtype == from_float[key].dtype, key
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(from_float[key]), err_msg=key)

    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    tokens, quantization = run_engine(int8_dir, prompts)
    assert quantization == "int8"
    assert tokens == run_engine(float_dir, prompts, "int8")[0]


# ---------------------------------------------------------------------------------------------- host vs device


@pytest.mark.parametrize("shape,in_axes", [((96, 40), (0,)), ((6, 16, 40), (0, 1)), ((40, 6, 16), (0,))])
def test_quantize_kernel_host_and_device_agree(shape, in_axes):
    """`quantize_kernel` in numpy (the converter, `load_hf_params`) and under jit (`quantize_tree`: a float folder
    quantized at load) give the same q and scales bit for bit, on grid-valued weights (what dequantized GGUF
    blocks are: `d * q4`), where half of w/scale's roundings would be ties an ulp could move."""
    from sarathi_jax.models.quantization import quantize_kernel

    rng = np.random.default_rng(0)
    out_shape = tuple(n for i, n in enumerate(shape) if i not in in_axes)
    steps = rng.uniform(1e-4, 1e-1, size=out_shape).astype(np.float32)
    w = (rng.integers(-8, 8, size=shape).astype(np.float32) * np.expand_dims(steps, in_axes)).astype(np.float32)
    w[..., :3] = rng.standard_normal(w[..., :3].shape)  # and some ordinary values
    w[..., 3] = 0  # a channel of zeros: scale 0, q 0
    q_host, scale_host = quantize_kernel(w, in_axes, "int8")
    q_dev, scale_dev = jax.jit(lambda x: quantize_kernel(x, in_axes, "int8"))(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(scale_dev), scale_host)
    np.testing.assert_array_equal(np.asarray(q_dev), q_host)
    assert q_host.dtype == np.int8 and scale_host.dtype == np.float32 and not scale_host[..., 3].any()
