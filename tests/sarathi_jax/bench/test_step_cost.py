"""`python -m sarathi_jax.bench.step_cost`: FLOP and byte counts by hand, floors from given rates, and one
fast end-to-end run on tiny-llama where every composition fits the 16-token bucket (one compile)."""

from __future__ import annotations

import json

import pytest

from sarathi_jax.bench import step_cost as sc
from sarathi_jax.models.presets import get_preset


def tiny_shape() -> sc.ModelShape:
    return sc.ModelShape.from_model_config(get_preset("tiny-llama"), "float32")


def test_matmul_params_by_hand():
    shape = tiny_shape()
    # hidden 256, 4 heads x 64 (q, o: 256x256), 2 KV heads x 64 (k, v: 256x128), SwiGLU MLP 3 x 256x768, 4 layers
    per_layer = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 768
    assert per_layer == 786_432
    assert shape.layer_matmul_params == 4 * per_layer
    assert shape.head_params == 32000 * 256
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads x 64, float32


def test_work_by_hand():
    shape = tiny_shape()
    # two decodes at context 16 plus a fresh 8-token prompt (which samples: it reaches the prompt's end)
    chunks = sc.decode_chunks(2, 16) + [sc.Chunk(0, 8)]
    w = sc.work(shape, chunks)
    assert (w.num_tokens, w.num_sampled) == (10, 3)
    assert w.attention_pairs == 2 * 17 + 8 * 9 // 2 == 70
    assert w.linear_flops == 2 * 3_145_728 * 10
    assert w.head_flops == 2 * 8_192_000 * 3
    assert w.attention_flops == 4 * 4 * 4 * 64 * 70  # QK^T and PV, 4 layers, 4 query heads, head_dim 64
    assert w.flops == 62_914_560 + 49_152_000 + 286_720
    weights = (3_145_728 + 8_192_000 + 9 * 256) * 4  # tied embedding: the LM head is the table, read once
    assert weights == 11_340_032 * 4  # every parameter of the preset (its tree holds 11,340,032)
    assert w.weight_bytes == weights
    assert w.kv_read_bytes == 32 * 4096 and w.kv_write_bytes == 10 * 4096
    assert w.bytes == weights + 42 * 4096
    # a non-final chunk samples nothing and sees the keys before it
    mid = sc.work(shape, [sc.Chunk(8, 4, seq_len=16)])
    assert (mid.num_sampled, mid.attention_pairs, mid.head_flops) == (0, 4 * 8 + 10, 0)


def test_floors_from_given_rates():
    w = sc.work(tiny_shape(), [sc.Chunk(0, 16)])
    compute, memory = sc.floors(w, sc.Rates(matmul_flops=2e9, bandwidth=5e8))
    assert compute == pytest.approx(w.flops / 2e9)
    assert memory == pytest.approx(w.bytes / 5e8)


def test_compositions():
    args = sc.parse_args(["--mode", "chunking,hybrid", "--prompt-len", "40", "--chunks", "16", "--tile-probe", "16",
                          "--decodes", "3", "--context", "5", "--whole-prompt", "24"])
    chunking = sc.compositions("chunking", args)
    by_label = {c.label: c for c in chunking}
    steps = by_label["prompt 40 in chunks of 16"].steps
    assert [[(c.start, c.num_new_tokens, c.sample) for c in s] for s in steps] == [
        [(0, 16, False)], [(16, 16, False)], [(32, 8, True)]]
    assert len(by_label["prompt 40 unchunked"].steps) == 1  # the reference is added automatically
    assert [c.steps[0][0].num_new_tokens for c in chunking if c.info.get("probe") == "iteration"] == [16, 17]
    hybrid = sc.compositions("hybrid", args)
    assert [sum(c.num_new_tokens for c in comp.steps[0]) for comp in hybrid] == [3, 3 + 16, 3 + 24]
    assert sc.engine_needs(chunking + hybrid) == {"max_tokens": 40, "max_seqs": 4, "max_len": 40}


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
    assert doc["engine"]["buckets"] == [16] and doc["engine"]["model"] == "tiny-llama"
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
    assert chunked["num_steps"] == 2 and chunked["buckets"] == [16, 16] and "overhead" in chunked
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "x floor" in text and "decode x2 @ctx 12" in text


def test_cost_model_fit_recovers_coefficients():
    truth = sc.BucketCostModel({16: 0.010, 32: 0.012, 64: 0.020}, decode_kv_s=3e-7, prefill_pair_s=2e-8)
    comps = sc.calibration_compositions([16, 32, 64], [16, 96], max_decodes=8)
    batches = [c.steps[0] for c in comps]
    assert any(sum(c.num_new_tokens == 1 for c in b) == 1 for b in batches)  # decode count varies per bucket
    fitted = sc.BucketCostModel.fit(batches, [truth.chunks_time(b) for b in batches], buckets=[16, 32, 64],
                                    row_group=32)
    assert fitted.base_s == pytest.approx(truth.base_s, rel=1e-6)
    assert fitted.decode_kv_s == pytest.approx(3e-7, rel=1e-6)
    assert fitted.prefill_pair_s == pytest.approx(2e-8, rel=1e-6)
    # padding: 17 tokens cost the 32 bucket; an unmeasured 48 bucket is interpolated; past the top: extrapolated
    assert truth.chunks_time([sc.Chunk(0, 17)]) == pytest.approx(0.012 + 2e-8 * 17 * 18 / 2)
    assert truth.with_buckets([16, 32, 48]).chunks_time([sc.Chunk(0, 40)]) == pytest.approx(0.016 + 2e-8 * 40 * 41 / 2)
    assert truth.base(128) == pytest.approx(0.036)
    # decodes: sorted by KV length in groups of min(row_group, bucket) rows, each group costs its longest row
    dec = sc.decode_chunks(3, 99) + sc.decode_chunks(30, 9)  # 33 decodes: groups {99 x3, 9 x29} and {9}
    assert truth.features(dec) == (64, 32 * (100 + 10), 0)
    assert truth.features(sc.decode_chunks(1, 99)) == truth.features(sc.decode_chunks(16, 99)) == (16, 16 * 100, 0)
    assert sc.BucketCostModel.from_dict(json.loads(json.dumps(truth.to_dict()))).to_dict() == truth.to_dict()


def test_cost_model_drives_the_simulated_bench(tmp_path, capsys):
    from sarathi_jax.bench.__main__ import main as bench_main

    path = tmp_path / "cm.json"
    path.write_text(json.dumps(sc.BucketCostModel({16: 0.01, 32: 0.02, 64: 0.04}, 0.0, 0.0).to_dict()))
    out = tmp_path / "out"
    rc = bench_main(["--simulate", "--cost-model", str(path), "--scheduler", "sarathi", "--token-budget", "32",
                     "--num-requests", "6", "--qps", "50", "--prompt-len", "20", "--output-len", "3",
                     "--out", str(out), "--no-plots", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((out / "sarathi-32.json").read_text())
    # every iteration costs its padded bucket: budget 32 -> the engine's buckets are 16 and 32
    for it in doc["iterations"]:
        n = it["num_prefill_tokens"] + it["num_decode_tokens"]
        assert it["duration"] == pytest.approx(0.01 if n <= 16 else 0.02)
    assert bench_main(["--cost-model", str(path), "--quiet"]) == 2  # only with --simulate
