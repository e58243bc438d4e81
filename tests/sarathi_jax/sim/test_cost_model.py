"""`sarathi_jax.sim.cost_model.BucketCostModel`: the fit recovers known coefficients, padding and interpolation,
and a saved model drives the simulated bench."""

from __future__ import annotations

import json

import pytest

from sarathi_jax.bench.roofline import decode_chunks
from sarathi_jax.bench.step_timer import calibration_compositions
from sarathi_jax.sim.cost_model import BucketCostModel, Chunk


def test_cost_model_fit_recovers_coefficients():
    truth = BucketCostModel({16: 0.010, 32: 0.012, 64: 0.020}, decode_kv_s=3e-7, prefill_pair_s=2e-8)
    comps = calibration_compositions([16, 32, 64], [16, 96], max_decodes=8)
    batches = [c.steps[0] for c in comps]
    assert any(sum(c.num_new_tokens == 1 for c in b) == 1 for b in batches)  # decode count varies per bucket
    fitted = BucketCostModel.fit(batches, [truth.chunks_time(b) for b in batches], buckets=[16, 32, 64],
                                    row_group=32)
    assert fitted.base_s == pytest.approx(truth.base_s, rel=1e-6)
    assert fitted.decode_kv_s == pytest.approx(3e-7, rel=1e-6)
    assert fitted.prefill_pair_s == pytest.approx(2e-8, rel=1e-6)
    # padding: 17 tokens cost the 32 bucket; an unmeasured 48 bucket is interpolated; past the top: extrapolated
    assert truth.chunks_time([Chunk(0, 17)]) == pytest.approx(0.012 + 2e-8 * 17 * 18 / 2)
    assert truth.with_buckets([16, 32, 48]).chunks_time([Chunk(0, 40)]) == pytest.approx(0.016 + 2e-8 * 40 * 41 / 2)
    assert truth.base(128) == pytest.approx(0.036)
    # decodes: sorted by KV length in groups of min(row_group, bucket) rows, each group costs its longest row
    dec = decode_chunks(3, 99) + decode_chunks(30, 9)  # 33 decodes: groups {99 x3, 9 x29} and {9}
    assert truth.features(dec) == (64, 32 * (100 + 10), 0)
    assert truth.features(decode_chunks(1, 99)) == truth.features(decode_chunks(16, 99)) == (16, 16 * 100, 0)
    assert BucketCostModel.from_dict(json.loads(json.dumps(truth.to_dict()))).to_dict() == truth.to_dict()


def test_cost_model_drives_the_simulated_bench(tmp_path, capsys):
    from sarathi_jax.bench.__main__ import main as bench_main

    path = tmp_path / "cm.json"
    path.write_text(json.dumps(BucketCostModel({16: 0.01, 32: 0.02, 64: 0.04}, 0.0, 0.0).to_dict()))
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
