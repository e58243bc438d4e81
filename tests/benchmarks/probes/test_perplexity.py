"""`python -m benchmarks.probes.perplexity` on the tiny HF Llama (float32, with a tokenizer): its perplexity
equals HF transformers' loss on the same token windows, and `--compare` runs int8 beside it."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.probes import perplexity as probe

WINDOW, MAX_TOKENS = 64, 150  # windows of 64, 64 and 22 tokens


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint):
    return hf_checkpoint("llama")


def hf_nll(model_dir, ids: list[int], window: int) -> tuple[float, int]:
    """Summed NLL (nats) and tokens scored by HF's float32 eager forward: each window's mean `loss` over its
    len - 1 shifted labels, times len - 1."""
    import torch

    from checkpoints_convert.verifier import load_hf_model

    model = load_hf_model(model_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for chunk in probe.windows(ids, window):
            batch = torch.tensor([chunk])
            total += float(model(input_ids=batch, labels=batch).loss.double()) * (len(chunk) - 1)
            count += len(chunk) - 1
    return total, count


def test_windows_cover_the_ids_and_drop_a_lone_last_token():
    assert probe.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert probe.windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # [8] predicts nothing


def test_perplexity_equals_hf_loss_and_int8_runs(llama_dir, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    assert probe.main(["--model", str(llama_dir), "--window", str(WINDOW), "--max-tokens", str(MAX_TOKENS),
                       "--compare", "--json-out", str(out)]) == 0
    figures = json.loads(out.read_text())
    base, quantized = figures["runs"]
    ids = probe.text_ids(llama_dir, probe.DEFAULT_TEXT, MAX_TOKENS)
    assert len(ids) == MAX_TOKENS and ids[0] == 1  # the tokenizer's BOS, as HF's default encoding
    nll, count = hf_nll(llama_dir, ids, WINDOW)
    assert base["quantization"] is None and base["windows"] == 3 and base["tokens_scored"] == count == MAX_TOKENS - 3
    assert math.isfinite(base["perplexity"]) and base["perplexity"] > 1
    assert abs(base["perplexity"] / math.exp(nll / count) - 1) <= 1e-4
    # int8: the same tokens scored, a finite perplexity near float32's, smaller weights
    assert quantized["quantization"] == "int8" and quantized["tokens_scored"] == count
    assert math.isfinite(quantized["perplexity"]) and abs(figures["relative_difference"]) < 0.05
    assert quantized["weight_bytes"] < base["weight_bytes"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("float32: perplexity") and lines[2].startswith("int8: perplexity")
    assert lines[3].startswith("int8 vs float32: perplexity")


def test_a_window_beyond_the_model_length_is_refused(llama_dir):
    with pytest.raises(ValueError, match="max length 1024"):
        probe.perplexity(str(llama_dir), list(range(8)), 2048)
