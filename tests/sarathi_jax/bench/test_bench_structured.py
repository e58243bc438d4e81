"""Constrained requests in the bench (--structured-share, --structured-outputs): parsing and its errors, the
seeded choice of the constrained requests, and the bench end to end on the real engine with a tiny random model
whose tokenizer llguidance reads (tests/conftest.py's `ascii_llama`): one engine for every share, the
constraint reaching the constrained requests only."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest

from sarathi_jax.bench.__main__ import main
from sarathi_jax.bench.report import safe_name
from sarathi_jax.bench.structured import SCHEMA, constrained_rows, parse_constraint, parse_shares, share_label
from sarathi_jax.request.structured_outputs import StructuredOutputs


def test_parse_shares() -> None:
    assert parse_shares("0, 0.5,1") == [0.0, 0.5, 1.0]
    assert parse_shares("0.25,0.25") == [0.25]
    for text, words in [("", "empty"), ("0,x", "'x' is not a number"), ("1.5", "not a fraction in [0, 1]"),
                        ("-0.1", "not a fraction")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_shares(text)
    assert [share_label(f) for f in (0.0, 0.5, 1.0, 0.125)] == ["+constrained0", "+constrained50",
                                                              "+constrained100", "+constrained12.5"]


def test_parse_constraint(tmp_path: Path) -> None:
    assert parse_constraint("schema") == StructuredOutputs.parse({"json": SCHEMA})
    assert parse_constraint("json_object") == StructuredOutputs.parse({"json_object": True})
    assert parse_constraint('{"regex": "[a-z]+"}') == StructuredOutputs("regex", "[a-z]+")
    path = tmp_path / "choice.json"
    path.write_text(json.dumps({"choice": ["yes", "no"]}))
    assert parse_constraint(f"@{path}") == StructuredOutputs.parse({"choice": ["yes", "no"]})
    for spec, words in [("yaml", "expected schema or json_object"), ("[1]", "a JSON object, not list"),
                        ('{"regex": "("}', "invalid regex"), ('{"regex": "a", "choice": ["a"]}', "exactly one"),
                        (f"@{tmp_path / 'missing.json'}", "No such file")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_constraint(spec)


def test_constrained_rows_are_seeded_exact_and_nested() -> None:
    rows = {f: constrained_rows(24, f, seed=3) for f in (0.0, 0.25, 0.5, 1.0)}
    assert [int(r.sum()) for r in rows.values()] == [0, 6, 12, 24]
    assert not (rows[0.25] & ~rows[0.5]).any()  # a smaller share's constrained requests are among a larger one's
    np.testing.assert_array_equal(rows[0.5], constrained_rows(24, 0.5, seed=3))
    assert not np.array_equal(rows[0.5], constrained_rows(24, 0.5, seed=4))
    assert 0 < rows[0.5][:12].sum() < 12  # spread over the run, not the first half


@pytest.mark.parametrize(("argv", "words"), [
    (["--structured-share", "2"], "not a fraction in [0, 1]"),
    (["--structured-outputs", "schema"], "add --structured-share"),
    (["--structured-share", "0.5", "--structured-outputs", '{"regex": "("}'], "invalid regex"),
    (["--structured-share", "0,0.5", "--simulate"], "real engine only"),
    (["--structured-share", "1", "--endpoint", "127.0.0.1:1"], "real engine only"),
])
def test_bench_refuses_bad_structured_options(argv: list[str], words: str, capsys) -> None:
    assert main(["--quiet", *argv]) == 2
    assert words in capsys.readouterr().err


def test_the_bench_constrains_its_share_of_requests_on_one_engine(ascii_llama: Path, tmp_path: Path, capsys) -> None:
    """Shares 0, 0.5 and 1 of 8 requests under a regex that ends after at most 3 letters: the constrained
    requests finish "stop" with at most 3 tokens of lowercase letters, the others run to their output length
    ("length", EOS ignored), and the three runs share one engine."""
    rc = main(["--model", str(ascii_llama), "--scheduler", "sarathi", "--token-budget", "64", "--max-num-seqs", "8",
               "--max-model-len", "128", "--num-blocks", "64", "--num-requests", "8", "--qps", "50",
               "--prompt-len", "uniform:4:24", "--output-len", "uniform:8:16", "--structured-share", "0,0.5,1",
               "--structured-outputs", '{"regex": "[a-z]{1,3}"}', "--out", str(tmp_path), "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert err.count("building LLMEngine") == 1 and err.count("on the engine of the run before") == 2
    labels = ["sarathi-64+constrained0", "sarathi-64+constrained50", "sarathi-64+constrained100"]
    assert [r["run"] for r in csv.DictReader(open(tmp_path / "summary.csv"))] == labels
    expected = {label: constrained_rows(8, share, seed=0) for label, share in zip(labels, (0.0, 0.5, 1.0))}
    for label in labels:
        doc = json.load(open(tmp_path / f"{safe_name(label)}.json"))
        structured = doc["summary"]["structured_outputs"]
        rows = expected[label]
        assert structured["num_constrained"] == int(rows.sum())
        for constrained, request in zip(rows, doc["requests"]):
            if constrained:
                assert request["finish_reason"] == "stop" and 1 <= request["num_output_tokens"] <= 3, request
            else:
                assert request["finish_reason"] == "length" and request["num_output_tokens"] == request["max_tokens"]
        if rows.any():
            assert structured["finish_reasons"] == {"stop": int(rows.sum())}
