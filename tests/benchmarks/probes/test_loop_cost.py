"""`python -m benchmarks.probes.loop_cost`: one tiny end-to-end run on tiny-llama (a 16-token budget: one
bucket on an accelerator, 4, 8 and 16 on a CPU). Checks what was measured and that the overlapped engine really
kept a batch in flight; no timing assertions (speed lives in the benchmark, not in tests)."""

from __future__ import annotations

import json

import pytest

from benchmarks.probes import loop_cost as lc
from sarathi_jax.config.sizing import platform_buckets


def test_cli_runs_both_loops_on_tiny_model(tmp_path, capsys):
    out = tmp_path / "loop.json"
    rc = lc.main([
        "--model", "tiny-llama", "--batch", "2", "--context", "12", "--prompt-len", "40", "--token-budget", "16",
        "--max-num-seqs", "4", "--steps", "3", "--rounds", "1", "--replays", "2",
        "--matmul-rate", "1e10", "--bandwidth", "2e9", "--json", str(out), "--quiet",
    ])
    assert rc == 0
    doc = json.loads(out.read_text())
    backend = doc["platform"]["backend"]
    assert backend and doc["engine"]["buckets"] == list(platform_buckets(16, backend))
    assert doc["rates"]["matmul_flops_per_s"] == 1e10 and doc["rates"]["bandwidth_bytes_per_s"] == 2e9
    rows = {(r["workload"], r["loop"]): r for r in doc["rows"]}
    assert set(rows) == {(w, loop) for w in ("decode", "mixed") for loop in ("sync", "async")}
    for (workload, loop), r in rows.items():
        assert r["batch"] == 2 and r["num_timed_steps"] == 3 and len(r["wall_s"]) == 3
        assert r["wall_mean_s"] > 0 and r["wall_p50_s"] > 0 and r["device_s"] > 0 and r["host_cpu_s"] > 0
        assert len(r["device_per_round_s"]) == 1 and r["device_s"] == r["device_per_round_s"][0]
        assert r["device_busy_fraction"] == pytest.approx(r["device_s"] / r["wall_mean_s"])
        assert r["compute_floor_s"] == pytest.approx(r["flops_per_step"] / 1e10)
        assert r["memory_floor_s"] == pytest.approx(r["bytes_per_step"] / 2e9)
        assert r["compilations_during_timing"] == 0
        assert r["decodes_per_step"] == 2  # the two decodes are in every timed step
        # the overlapped engine holds one batch after every step; the synchronous one none
        assert r["in_flight_after_step"] == ([1] if loop == "async" else [0]) and r["in_flight_ok"]
        if workload == "mixed":  # every timed step fills the budget with a prefill chunk
            assert r["tokens_per_step"] == 16 and r["prefill_tokens_per_step"] == [14, 14, 14]
        else:
            assert r["tokens_per_step"] == 2 and r["prefill_tokens_per_step"] == [0, 0, 0]
    for workload in ("decode", "mixed"):
        a, s = rows[(workload, "async")], rows[(workload, "sync")]
        assert a["hidden_host_s"] == pytest.approx(s["wall_mean_s"] - a["wall_mean_s"])
        assert a["ratio_mean"] == pytest.approx(a["wall_mean_s"] / s["wall_mean_s"])
        assert "hidden_host_s" not in s
    # the shadowed replays left both engines intact: greedy decodes agree token for token
    agree = doc["decode_tokens_agree"]["2"]
    assert agree["all_equal"] and agree["num_requests"] == 2 and agree["tokens_compared"] > 0
    text = capsys.readouterr().out
    assert "JAX platform: " in text and "async/sync" in text and "hidden ms" in text
