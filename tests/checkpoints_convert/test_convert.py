"""`python -m checkpoints_convert`: HF folder -> Orbax checkpoint, restored by `load_model` and run by the engine.

For Llama (the sharded `hf_checkpoint("llama")`, with tokenizer) and both Falcon variants (sharded
`falcon_checkpoint` fixtures): convert, restore, compare logits with HF (<= 1e-4 relative, float32) and greedy
generation through `LLMEngine` with HF `generate`; then atomicity, --force, each error case and the CLI.
Peak memory of a ~200 MB conversion is in test_memory.py.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import checkpoints_convert.orbax_writer as writer_module
from checkpoints_convert import ConversionError, convert, verify
from checkpoints_convert.__main__ import main
from checkpoints_convert.verifier import engine_logits, hf_logits
from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.models import CheckpointError, ModelConfig, load_model
from sarathi_jax.models.loader import CHECKPOINT_MARKER

MODELS = ("llama", "falcon-new", "falcon-7b")
PROMPT_LENGTHS = (5, 17, 40)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hf_dir(hf_checkpoint, falcon_checkpoint):
    def get(name: str) -> Path:
        return falcon_checkpoint(name) if name.startswith("falcon") else hf_checkpoint(name)

    return get


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """name -> float32 Orbax folder converted from that HF folder (once per module)."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            out = tmp_path_factory.mktemp(f"orbax-{name}") / "ckpt"
            convert(hf_dir(name), out, "float32", log=lambda message: None)
            cache[name] = out
        return cache[name]

    return get


def rel_err(got: Any, ref: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def prompts_for(folder: Path) -> list[list[int]]:
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    rng = np.random.default_rng(4321)
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


@functools.cache
def hf_greedy(folder: Path) -> list[list[int]]:
    """HF `generate` greedy continuations of `prompts_for(folder)`, one prompt at a time, EOS disabled."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                              bos_token_id=None)
    outs = []
    with torch.no_grad():
        for prompt in prompts_for(folder):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def run_engine(model_dir: Path, prompts: list[list[int]] | list[str], **params: Any) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), token_budget=64, max_num_seqs=8, num_blocks=256,
                                    max_model_len=512), warmup=False)
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module", autouse=True)
def full_float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


# ---------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("name", MODELS)
def test_converted_checkpoint_matches_hf(converted, hf_dir, name):
    out, src = converted(name), hf_dir(name)
    marker = json.loads((out / CHECKPOINT_MARKER).read_text())
    assert marker["architecture"] == ModelConfig.from_pretrained(src).architecture and marker["dtype"] == "float32"
    assert (out / "config.json").read_text() == (src / "config.json").read_text()
    # Restored params are exactly the ones loaded from safetensors.
    _, restored = load_model(out, jnp.float32)
    _, direct = load_model(src, jnp.float32)
    assert jax.tree.structure(restored) == jax.tree.structure(direct)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(direct)):
        assert isinstance(a, jax.Array) and a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Logits of the converted checkpoint through the model forward vs HF.
    ids = prompts_for(src)[1]
    assert rel_err(engine_logits(out, ids, "float32"), hf_logits(src, ids)) <= 1e-4


@pytest.mark.parametrize("name", MODELS)
def test_engine_greedy_matches_hf_generate(converted, hf_dir, name):
    out, src = converted(name), hf_dir(name)
    assert run_engine(out, prompts_for(src)) == hf_greedy(src)


def test_tokenizer_copied_and_text_prompts(converted, hf_dir):
    out = converted("llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (hf_dir("llama") / name).read_bytes()
    engine = LLMEngine(EngineConfig(model=str(out), token_budget=64, max_num_seqs=8, num_blocks=256,
                                    max_model_len=512), warmup=False)
    assert engine.tokenizer is not None and engine.tokenizer.encode("the quick brown fox")[0] == 1


def test_restore_with_explicit_shardings_and_dtype(converted):
    out = converted("falcon-new")
    config = ModelConfig.from_pretrained(out)
    device = jax.devices()[0]
    from sarathi_jax.models import checkpoint_param_shapes

    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), checkpoint_param_shapes(config))
    _, params = load_model(out, jnp.bfloat16, shardings=shardings)
    leaves = jax.tree.leaves(params)
    assert all(x.dtype == jnp.bfloat16 and x.sharding == jax.sharding.SingleDeviceSharding(device) for x in leaves)


def test_restore_into_a_tensor_parallel_mesh(converted):
    """Each leaf restored straight into a 2-device NamedSharding (heads / kv_heads / mlp split)."""
    import flax.linen as nn
    from jax.sharding import Mesh, NamedSharding

    from sarathi_jax.models import checkpoint_param_logical_axes, param_logical_axes

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (tests/conftest.py asks XLA for 8 virtual CPU devices)")
    out = converted("falcon-new")
    config = ModelConfig.from_pretrained(out)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    rules = [("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", None), ("embed", None), ("head_dim", None)]
    shardings = nn.logical_to_mesh_sharding(checkpoint_param_logical_axes(config), mesh, rules)
    _, params = load_model(out, jnp.float32, shardings=shardings)
    _, direct = load_model(out, jnp.float32)
    # Restored with q split over heads, then fused on the same devices: [layers, embed, kv_heads, 2 + 2, head_dim]
    qkv = params["layers"]["self_attention"]["qkv_proj"]["kernel"]
    assert isinstance(qkv.sharding, NamedSharding)
    assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp", None, None)
    assert {shard.data.shape for shard in qkv.addressable_shards} == {(config.num_hidden_layers, 64, 1, 4, 16)}
    serving = nn.logical_to_mesh_sharding(param_logical_axes(config), mesh, rules)
    for a, b, s in zip(jax.tree.leaves(params), jax.tree.leaves(direct), jax.tree.leaves(serving)):
        assert a.sharding == s
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_conversion_and_verify(hf_dir, tmp_path):
    out = tmp_path / "bf16"
    result = convert(hf_dir("falcon-7b"), out, "bfloat16", log=lambda message: None)
    assert result.dtype == "bfloat16" and result.num_bytes == 2 * result.num_params
    _, params = load_model(out, jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    outcome = verify(out, hf_dir("falcon-7b"), "bfloat16", log=lambda message: None)
    assert outcome.reference == "transformers" and 0 < outcome.max_rel_diff < 5e-2 and outcome.passed


def test_verify_without_transformers(converted, hf_dir, monkeypatch):
    import checkpoints_convert.verifier as verify_module

    monkeypatch.setattr(verify_module, "hf_logits", lambda folder, ids, quantization=None: None)  # as when the import fails
    messages: list[str] = []
    outcome = verify(converted("falcon-7b"), hf_dir("falcon-7b"), "float32", log=messages.append)
    assert outcome.passed and outcome.max_rel_diff is None and outcome.reference == "none"
    assert "transformers is not installed" in messages[-1]


def test_cli_convert_verify_and_progress(hf_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["--hf", str(hf_dir("falcon-new")), "--out", str(out), "--dtype", "float32", "--verify"]) == 0
    printed = capsys.readouterr().out
    assert ("layers/self_attention/q_proj/kernel (2, 64, 4, 16) <- transformer.h.0.self_attention.query_key_value"
            ".weight .. transformer.h.1.self_attention.query_key_value.weight") in printed
    assert "max relative logit difference vs transformers" in printed and ": OK" in printed
    diff = float(printed.split("max relative logit difference vs transformers ")[1].split()[0])
    assert diff <= 1e-4
    # An impossible threshold fails with exit status 3 and keeps the folder.
    assert main(["--hf", str(hf_dir("falcon-new")), "--out", str(out), "--force", "--verify",
                 "--verify-threshold", "0", "--quiet"]) == 3
    assert "verify failed" in capsys.readouterr().err and (out / CHECKPOINT_MARKER).exists()


# ---------------------------------------------------------------------------------------------- atomicity


def test_interrupted_conversion_leaves_nothing_complete(hf_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_read_param = writer_module.read_param
    calls = {"n": 0}

    def failing_read_param(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("simulated crash after 5 tensors")
        return real_read_param(*args, **kwargs)

    monkeypatch.setattr(writer_module, "read_param", failing_read_param)
    # Small batches, so that some partial saves really happened before the crash.
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert(hf_dir("llama"), out, "float32", log=lambda message: None, min_batch_bytes=1)
    assert not out.exists() and list(tmp_path.iterdir()) == []

    # A hard kill (no cleanup runs) leaves only the hidden temporary sibling, which is not a loadable checkpoint.
    calls["n"] = 0
    monkeypatch.setattr(writer_module.shutil, "rmtree", lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert(hf_dir("llama"), out, "float32", log=lambda message: None, min_batch_bytes=1)
    monkeypatch.undo()
    leftovers = list(tmp_path.iterdir())
    assert not out.exists() and [p.name for p in leftovers] == [".out.converting"]
    assert not (leftovers[0] / CHECKPOINT_MARKER).exists()
    assert any((leftovers[0] / "params.partial_save").iterdir())  # some parameters had been saved
    shutil.copy(hf_dir("llama") / "config.json", leftovers[0] / "config.json")  # even with a config beside it
    with pytest.raises(CheckpointError, match="incomplete converted checkpoint"):
        load_model(leftovers[0])

    # The next run removes the leftover and succeeds.
    messages: list[str] = []
    convert(hf_dir("llama"), out, "float32", log=messages.append)
    assert any("leftover of an interrupted conversion" in m for m in messages)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / CHECKPOINT_MARKER).exists()


def test_marker_is_checked_at_load(converted, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(converted("falcon-7b"), copy)
    (copy / CHECKPOINT_MARKER).unlink()
    with pytest.raises(CheckpointError, match="incomplete converted checkpoint"):
        load_model(copy)


def test_old_per_layer_format_is_refused_with_how_to_reconvert(converted, tmp_path):
    """Format v1 (one `layers_{i}` tree per layer, before the layers were scanned) cannot be loaded: the error
    says so and gives the command that re-converts it."""
    copy = tmp_path / "v1"
    shutil.copytree(converted("falcon-7b"), copy)
    marker = json.loads((copy / CHECKPOINT_MARKER).read_text())
    marker["format_version"] = 1
    (copy / CHECKPOINT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"format v1.*python -m checkpoints_convert --hf HF_DIR --out DIR --force"):
        load_model(copy)


@pytest.mark.parametrize("name", ["falcon-7b", "llama"])
def test_format_v2_loads_when_tied_and_is_refused_with_how_to_reconvert_when_untied(converted, tmp_path, name):
    """Format v2 stored an untied LM head [embed, vocab]; v3 stores it [vocab, embed]. A v2 folder of a tied
    model holds the same arrays as v3 and loads; an untied one is refused with the command that re-converts it."""
    copy = tmp_path / "v2"
    shutil.copytree(converted(name), copy)
    marker = json.loads((copy / CHECKPOINT_MARKER).read_text())
    tied = "lm_head" not in marker["params"]
    assert tied == (name == "falcon-7b")  # the fixtures: tied Falcon-7B, untied Llama
    marker["format_version"] = 2
    (copy / CHECKPOINT_MARKER).write_text(json.dumps(marker))
    if tied:
        model_config, params = load_model(copy)[:2]
        assert "lm_head" not in params
    else:
        with pytest.raises(CheckpointError, match=r"format v2.*\[vocab, embed\].*--force"):
            load_model(copy)


def test_existing_output_is_refused_unless_force(converted, hf_dir, tmp_path):
    out = converted("falcon-7b")
    with pytest.raises(ConversionError, match="already holds a checkpoint; pass --force"):
        convert(hf_dir("falcon-7b"), out, "float32", log=lambda message: None)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="is not empty; pass --force"):
        convert(hf_dir("falcon-7b"), other, "float32", log=lambda message: None)
    # --force replaces it atomically; an empty folder is fine without it.
    convert(hf_dir("falcon-7b"), other, "float32", force=True, log=lambda message: None)
    assert (other / CHECKPOINT_MARKER).exists() and not (other / "notes.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["other"]
    empty = tmp_path / "empty"
    empty.mkdir()
    convert(hf_dir("falcon-7b"), empty, "float32", log=lambda message: None)
    assert (empty / CHECKPOINT_MARKER).exists()


# ---------------------------------------------------------------------------------------------- errors


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture(hf_dir, tmp_path):
    folder = _copy_checkpoint(hf_dir("falcon-7b"), tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ConversionError, match="unsupported architecture 'GPT2LMHeadModel'; supported: "
                                              "LlamaForCausalLM, .*FalconForCausalLM"):
        convert(folder, tmp_path / "out", log=lambda message: None)
    (folder / "config.json").write_text(json.dumps(dict(config, alibi=True)))
    with pytest.raises(ConversionError, match="alibi=True"):
        convert(folder, tmp_path / "out", log=lambda message: None)
    assert not (tmp_path / "out").exists()


def _rewrite_tensor(folder: Path, name: str, fn) -> None:
    """Rewrite the shard that holds `name` with `fn(tensors)` applied (safetensors.numpy)."""
    from safetensors.numpy import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    fn(tensors)
    save_file(tensors, shard)


def test_missing_tensor(hf_dir, tmp_path):
    folder = _copy_checkpoint(hf_dir("falcon-new"), tmp_path / "src")
    name = "transformer.h.1.ln_mlp.bias"
    _rewrite_tensor(folder, name, lambda tensors: tensors.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        convert(folder, tmp_path / "out", log=lambda message: None)
    assert not (tmp_path / "out").exists()


def test_misshaped_tensor(hf_dir, tmp_path):
    folder = _copy_checkpoint(hf_dir("falcon-7b"), tmp_path / "src")
    name = "transformer.h.0.self_attention.query_key_value.weight"  # (4 + 2) heads x 16 rows, 64 columns
    _rewrite_tensor(folder, name, lambda tensors: tensors.update({name: tensors[name][:80]}))
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(80, 64\), expected \(96, 64\)"):
        convert(folder, tmp_path / "out", log=lambda message: None)


def test_corrupt_safetensors(hf_dir, tmp_path):
    folder = _copy_checkpoint(hf_dir("llama"), tmp_path / "src")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])  # truncated
    with pytest.raises(CheckpointError, match=rf"corrupt safetensors file '.*{shard.name}'.*truncated"):
        convert(folder, tmp_path / "out", log=lambda message: None)
    shard.write_bytes(data[:8] + b"{not json" + data[17:])  # garbled header
    with pytest.raises(CheckpointError, match=rf"corrupt safetensors file '.*{shard.name}'.*not valid JSON"):
        convert(folder, tmp_path / "out", log=lambda message: None)
    shard.write_bytes(b"\xff" * 7)
    with pytest.raises(CheckpointError, match="too short"):
        convert(folder, tmp_path / "out", log=lambda message: None)
    assert not (tmp_path / "out").exists()


def test_relative_paths_are_read_against_the_current_directory(hf_dir, tmp_path, monkeypatch):
    """`--hf hf --out out` as a user types it (Orbax's atomic save refuses relative paths: the converter makes them
    absolute where they enter, in the CLI and in `convert`)."""
    shutil.copytree(hf_dir("llama"), tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    assert main(["--hf", "hf", "--out", "out", "--quiet"]) == 0
    result = convert("hf", "api-out", "float32", log=lambda message: None)
    assert (tmp_path / "out" / CHECKPOINT_MARKER).is_file() and (tmp_path / "api-out" / CHECKPOINT_MARKER).is_file()
    assert not list(tmp_path.glob(".*converting"))  # the temporary folders were renamed into place
    config = EngineConfig(model="out")
    monkeypatch.chdir("/")
    load_model(config.model, jnp.float32)  # the config names the folder from anywhere
    assert result.out_dir == tmp_path / "api-out"


def test_cli_errors_exit_2(hf_dir, converted, tmp_path, capsys):
    assert main(["--hf", str(hf_dir("falcon-7b")), "--out", str(converted("falcon-7b"))]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["--hf", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no config.json" in capsys.readouterr().err
