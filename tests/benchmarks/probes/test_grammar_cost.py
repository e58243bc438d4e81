"""`benchmarks.probes.grammar_cost`: each token's bytes read back from a byte-level tokenizer.json, and a
tiny end-to-end run with llguidance (the one candidate that is a dependency) on a byte-level BPE whose document
walk and random documents come out valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from benchmarks.probes import grammar_cost


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|eos|>"])
    backend.train_from_iterator([json.dumps(grammar_cost.DOCUMENT), "Grüße, 你好 \t\n"], trainer=trainer)
    folder = tmp_path_factory.mktemp("tokenizer")
    backend.save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return folder


def test_load_vocab_reads_each_tokens_bytes(tokenizer_dir: Path) -> None:
    vocab = grammar_cost.load_vocab(tokenizer_dir)
    backend = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert vocab.eos_id == 0 and vocab.size == backend.get_vocab_size() and vocab.token_bytes[0] == b"<|eos|>"
    ids = backend.encode("Grüße, 你好 \t\n").ids
    assert b"".join(vocab.token_bytes[i] for i in ids).decode() == "Grüße, 你好 \t\n"


def test_an_llguidance_run_reports_a_valid_walk(tokenizer_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "figures.json"
    assert grammar_cost.main(["--model", str(tokenizer_dir), "--libraries", "llguidance", "--compiles", "1",
                              "--walks", "2", "--samples", "3", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["library"] == "llguidance" and result["walk_ok"] is True and result["valid"] == "3/3"
    assert result["mask_us"] > 0 and result["compile_s"] > 0
    assert "llguidance" in capsys.readouterr().out
