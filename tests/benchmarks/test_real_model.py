"""`python -m benchmarks.real_model --quantization int8 --compare-quantization` on the tiny HF Llama with a chat
template: the int8 engine runs the chats, then a float engine, and the figures carry both engines' weight bytes
and how many greedy sequences agree (the SmolLM2 run against HF is tests/checkpoints_convert/test_gguf.py's)."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.real_model import main as real_model_main
from tests.server.grpc_test_utils import PLAIN_CHAT_TEMPLATE


def test_int8_against_float_weights(hf_checkpoint, tmp_path, capsys):
    model = shutil.copytree(hf_checkpoint("llama"), tmp_path / "llama")
    (model / "chat_template.jinja").write_text(PLAIN_CHAT_TEMPLATE)
    questions = tmp_path / "questions.txt"
    questions.write_text("What is the capital of France?\nList three fruits.\n")
    out = tmp_path / "figures.json"
    assert real_model_main(["--model", str(model), "--prompts-file", str(questions), "--max-tokens", "6",
                            "--token-budget", "64", "--max-model-len", "256", "--quantization", "int8",
                            "--compare-quantization", "--json-out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["quantization"] == "int8" and figures["num_prompts"] == 2
    assert 0 < figures["weight_bytes"] < figures["float_weight_bytes"]
    assert 0 <= figures["identical_to_float"] <= 2
    assert figures["engine_output_tokens"] > 0 and figures["float_output_tokens"] > 0
    assert "int8 against float32 weights: greedy sequences token-identical" in capsys.readouterr().out


def test_int8_against_transformers_on_dequantized_weights(hf_checkpoint, tmp_path, capsys):
    """With `--reference`, transformers runs on the int8 round trip of the weights the engine computes with: the
    greedy sequences are token-identical, where the float engine's differ (the oracle of the quantized engine,
    not its float model)."""
    model = shutil.copytree(hf_checkpoint("llama"), tmp_path / "llama")
    (model / "chat_template.jinja").write_text(PLAIN_CHAT_TEMPLATE)
    questions = tmp_path / "questions.txt"
    questions.write_text("What is the capital of France?\nList three fruits.\nWhy is the sky blue?\nIs 91 prime?\n")
    out = tmp_path / "figures.json"
    assert real_model_main(["--model", str(model), "--reference", str(model), "--prompts-file", str(questions),
                            "--max-tokens", "40", "--token-budget", "64", "--max-model-len", "256",
                            "--quantization", "int8", "--compare-quantization", "--json-out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["quantization"] == "int8" and figures["hf_output_tokens"] > 0
    assert figures["identical_sequences"] == 4
    assert figures["identical_to_float"] < 4  # int8 moves some answers: the float model would not be the oracle
    assert "HF generate on int8-dequantized weights" in capsys.readouterr().out


def test_reference_refuses_fp8(capsys):
    with pytest.raises(SystemExit):
        real_model_main(["--model", "unused", "--reference", "unused", "--quantization", "fp8"])
    assert "int8-dequantized weights only, not fp8" in capsys.readouterr().err


def test_compare_quantization_needs_quantization(capsys):
    with pytest.raises(SystemExit):
        real_model_main(["--model", "unused", "--compare-quantization"])
    assert "--compare-quantization needs --quantization" in capsys.readouterr().err
