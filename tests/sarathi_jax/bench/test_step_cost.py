"""`python -m sarathi_jax.bench.step_cost`: one fast end-to-end run on tiny-llama where every composition
fits the 16-token budget (one bucket on an accelerator; 4, 8 and 16 on a CPU)."""

from __future__ import annotations

import json

import jax
import pytest

from sarathi_jax.bench import step_cost as sc
from sarathi_jax.config.sizing import bucket_for, platform_buckets


def test_cli_runs_on_tiny_model(tmp_path, capsys):
    out_json, out_png = tmp_path / "cost.json", tmp_path / "cost.png"
    rc = sc.main([
        "--mode", "decode,prefill,hybrid,chunking", "--batch-sizes", "1,2", "--context", "12", "--tokens", "8,16",
        "--decodes", "2", "--chunks", "4,8", "--whole-prompt", "12", "--prompt-len", "16", "--tile-probe", "0",
        "--token-budget", "16", "--max-num-seqs", "4", "--max-model-len", "32", "--num-blocks", "32",
        "--repeats", "2", "--matmul-rate", "1e10", "--bandwidth", "2e9", "--json", str(out_json),
        "--plot", str(out_png), "--quiet",
    ])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    buckets = platform_buckets(16, jax.default_backend())
    assert doc["engine"]["buckets"] == list(buckets)
    assert doc["engine"]["model"] == "tiny-llama"
    assert doc["rates"]["matmul_flops_per_s"] == 1e10 and doc["rates"]["bandwidth_bytes_per_s"] == 2e9
    rows = doc["rows"]
    assert [r["mode"] for r in rows].count("decode") == 2 and [r["mode"] for r in rows].count("chunking") == 3
    for r in rows:
        assert r["time_s"] > 0 and len(r["times_s"]) == 2
        assert r["compute_floor_s"] == pytest.approx(r["flops"] / 1e10)
        assert r["memory_floor_s"] == pytest.approx(r["bytes"] / 2e9)
        assert r["x_floor"] == pytest.approx(r["time_s"] / max(r["compute_floor_s"], r["memory_floor_s"]), rel=1e-6)
    hybrid = {r["label"]: r for r in rows if r["mode"] == "hybrid"}
    assert hybrid["2 decodes alone"]["vs_decode_alone"] == 1.0
    chunked = next(r for r in rows if r["mode"] == "chunking" and r["chunk"] == 8)
    assert chunked["num_steps"] == 2 and chunked["buckets"] == [bucket_for(buckets, 8)] * 2 and "overhead" in chunked
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "x floor" in text and "decode x2 @ctx 12" in text
