"""`python -m sarathi_jax.bench` end to end: the simulator with a hand-computable step cost (bench_fakes, fast),
the simulator as `--simulate` builds it, and the real engine on a tiny model."""

from __future__ import annotations

import csv
import gc
import json
import os

import pytest
from bench_fakes import sim_engine

from sarathi_jax.bench.__main__ import main


def check_outputs(out, labels, capacity=False):
    files = set(os.listdir(out))
    for label in labels:
        assert {f"{label}.json", f"{label}_requests.csv", f"{label}_iterations.csv"} <= files, files
        doc = json.load(open(out / f"{label}.json"))
        assert doc["label"] == label and doc["summary"]["num_requests"] == len(doc["requests"])
        assert doc["iterations"], "iteration records missing"
        rows = list(csv.DictReader(open(out / f"{label}_requests.csv")))
        assert len(rows) == len(doc["requests"]) and rows[0]["ttft"] != ""
    assert {"summary.csv", "summary.json", "tbt_cdf.png", "timeline.png"} <= files
    assert ("capacity.png" in files) == capacity
    for f in files:
        if f.endswith(".png"):
            assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = list(csv.DictReader(open(out / "summary.csv")))
    assert [r["run"] for r in summary] == labels
    return summary


def test_comparison_on_fake_engine(tmp_path, capsys):
    built = []

    def factory(kwargs):
        built.append(kwargs)
        return sim_engine(base=0.01, per_seq=0.001, per_prefill_token=1e-4 * (kwargs["token_budget"] / 256))

    rc = main(["--scheduler", "sarathi,vllm", "--token-budget", "256,512", "--num-requests", "30", "--qps", "20",
               "--prompt-len", "uniform:8:64", "--output-len", "10", "--slo-ttft", "0.1", "--slo-tbt", "0.05",
               "--out", str(tmp_path), "--quiet"], engine_factory=factory)
    assert rc == 0
    assert [(k["scheduler"], k["token_budget"]) for k in built] == [("sarathi", 256), ("sarathi", 512), ("vllm", 512)]
    assert built[0]["max_num_seqs"] == 32 and built[0]["max_model_len"] == 1024
    out = capsys.readouterr().out
    for needle in ("P50 TTFT", "P99 TBT", "req/s", "out tok/s", "preempt", "stalls", "goodput", "sarathi-256", "vllm"):
        assert needle in out, out
    summary = check_outputs(tmp_path, ["sarathi-256", "sarathi-512", "vllm"])
    assert all(r["num_completed"] == "30" for r in summary)


def test_each_engine_runs_with_its_start_up_heap_frozen(tmp_path):
    freeze_counts = []  # at each build (the engine before unfrozen) and at each request (the engine's frozen)

    def factory(kwargs):
        freeze_counts.append(("build", gc.get_freeze_count()))
        engine = sim_engine(base=0.01, per_seq=0.001, per_prefill_token=1e-4)
        add_request = engine.add_request

        def add_request_counted(*args, **kw):
            freeze_counts.append(("request", gc.get_freeze_count()))
            return add_request(*args, **kw)

        engine.add_request = add_request_counted
        return engine

    rc = main(["--scheduler", "sarathi", "--token-budget", "256,512", "--num-requests", "3", "--qps", "20", "--prompt-len", "uniform:8:16",
               "--output-len", "2", "--out", str(tmp_path), "--quiet", "--no-plots"], engine_factory=factory)
    assert rc == 0
    builds = [c for kind, c in freeze_counts if kind == "build"]
    requests = [c for kind, c in freeze_counts if kind == "request"]
    assert len(builds) >= 2 and set(builds) == {0}
    assert len(requests) == 3 * len(builds) and all(c > 0 for c in requests)
    assert gc.get_freeze_count() == 0  # nothing stays frozen after the bench


def test_trace_capacity_and_slo_multiple_on_fake_engine(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{40 + i},{400 + i}\n" for i in range(50)))
    out = tmp_path / "out"
    rc = main(["--scheduler", "sarathi", "--trace", str(trace), "--sample", "40", "--length-scale", "0.1",
               "--capacity", "--slo-tbt-multiple", "2", "--capacity-probes", "6", "--out", str(out), "--quiet"],
              engine_factory=lambda kw: sim_engine(base=0.01, per_seq=0.0005))
    assert rc == 0
    text = capsys.readouterr().out
    assert "capacity" in text and "TBT SLO: 28.0 ms (2x decode-only iteration 14.0 ms)" in text
    check_outputs(out, ["sarathi-128"], capacity=True)
    doc = json.load(open(out / "sarathi-128.json"))
    assert doc["workload"]["length_scale"] == 0.1 and doc["workload"]["prompt_len_max"] == 9  # round(89 * 0.1)
    cap = doc["capacity"]
    assert cap["capacity_qps"] > 0 and 1 <= len(cap["probes"]) <= 6
    assert doc["summary"]["tbt"]["p99"] <= cap["slo_tbt"]


def test_offline_clipping_and_rate_scale(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,100,10\n1,2000,100\n2,30,3\n")
    rc = main(["--trace", str(trace), "--rate-scale", "2", "--max-model-len", "200", "--quiet"],
              engine_factory=lambda kw: sim_engine(max_model_len=kw["max_model_len"]))
    assert rc == 0
    assert "3/3" in capsys.readouterr().out
    rc = main(["--offline", "--num-requests", "5", "--prompt-len", "16", "--output-len", "4", "--quiet"],
              engine_factory=lambda kw: sim_engine())
    assert rc == 0 and "offline" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace", "/nonexistent.csv"], "trace file not found"),
        (["--capacity"], "--capacity needs a TBT SLO"),
        (["--capacity", "--slo-tbt", "1", "--offline"], "drop --offline"),
        (["--scheduler", "sarathi,nope"], "unknown policy 'nope'"),
        (["--token-budget", "abc"], "--token-budget"),
        (["--prompt-len", "uniform:5"], "bad length spec"),
        (["--sample", "3"], "--sample needs --trace"),
        (["--devices", "2"], "--devices is simulator-only so far: add --simulate"),
        (["--disaggregation", "1:1", "--endpoint", "127.0.0.1:1"], "--disaggregation builds the engines here"),
        (["--simulate", "--disaggregation", "3:2", "--devices", "4"], "3:2 needs 5 devices, but --devices is 4"),
        (["--simulate", "--disaggregation", "2:x"], "the decode side 'x' is not DEVICES or DEVICES/TP"),
        (["--simulate", "--kv-link", "fast"], "--kv-link: kv link must be one of nvlink"),
    ],
)
def test_usage_errors(argv, message, capsys):
    rc = main(argv + ["--quiet"], engine_factory=lambda kw: sim_engine())
    assert rc == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err, err


def test_bad_trace_file_message(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("num_prefill_tokens,num_decode_tokens\n10,x\n")
    assert main(["--trace", str(bad), "--qps", "1", "--quiet"], engine_factory=lambda kw: sim_engine()) == 2
    assert "row 2, column 'num_decode_tokens': expected a number, got 'x'" in capsys.readouterr().err


def test_endpoint_runs_the_load_driver_in_a_child_process(tmp_path, capsys, monkeypatch):
    """--endpoint replays the workload through the load driver's command line in a child process
    (`fake_load_driver`: sarathi_jax.bench.loadgen's, on the simulator instead of a server) and reads the run back."""
    from sarathi_jax.bench import endpoint

    monkeypatch.setattr(endpoint, "LOAD_DRIVER", "fake_load_driver")
    rc = main(["--endpoint", "h:1", "--num-requests", "5", "--prompt-len", "8", "--output-len", "3",
               "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    assert "5/5" in capsys.readouterr().out
    assert {"h_1.json", "summary.csv", "tbt_cdf.png"} <= set(os.listdir(tmp_path))
    records = json.loads((tmp_path / "h_1.json").read_text())["requests"]
    assert [r["num_output_tokens"] for r in records] == [3] * 5 and all(r["error"] is None for r in records)

    assert main(["--endpoint", "refused:1", "--num-requests", "2", "--quiet"]) == 2
    assert "--endpoint refused:1: ConnectionError: refused" in capsys.readouterr().err
    monkeypatch.setattr(endpoint, "LOAD_DRIVER", "no_such_load_driver")
    assert main(["--endpoint", "h:1", "--num-requests", "2", "--quiet"]) == 2
    assert "No module named no_such_load_driver" in capsys.readouterr().err


def test_simulate_comparison(tmp_path, capsys):
    rc = main(["--simulate", "--scheduler", "sarathi,vllm", "--token-budget", "256", "--num-requests", "40",
               "--qps", "4", "--prompt-len", "uniform:64:900", "--output-len", "uniform:8:64", "--out", str(tmp_path),
               "--quiet"])
    assert rc == 0
    assert "virtual time" in capsys.readouterr().out
    summary = check_outputs(tmp_path, ["sarathi-256", "vllm"])
    assert all(r["num_completed"] == "40" for r in summary)


def test_simulate_disaggregated_beside_colocated(tmp_path, capsys):
    """--devices 4: colocated sarathi tensor parallel over 4; two splits of the same 4 devices on the same
    requests. Every run completes them all, and the iteration records name the instance that ran them."""
    rc = main(["--simulate", "--model", "llama-50m", "--scheduler", "sarathi", "--token-budget", "256",
               "--num-requests", "30", "--qps", "4", "--prompt-len", "uniform:64:900", "--output-len", "uniform:8:64",
               "--devices", "4", "--disaggregation", "2:2,1:3/1", "--slo-ttft", "1", "--slo-tbt", "0.1",
               "--out", str(tmp_path), "--quiet", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    summary = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [r["run"] for r in summary] == ["sarathi-256", "sarathi-256+pd2:2", "sarathi-256+pd1:3/1"]
    assert all(r["num_completed"] == "30" for r in summary)
    doc = json.load(open(tmp_path / "sarathi-256_pd1_3_1.json"))
    assert doc["config"]["engine"] == "DisaggregatedSimEngine" and doc["config"]["disaggregation"] == "1:3/1"
    instances = {r["instance"] for r in csv.DictReader(open(tmp_path / "sarathi-256_pd1_3_1_iterations.csv"))}
    assert instances == {"prefill0", "decode0", "decode1", "decode2"}
    colocated = json.load(open(tmp_path / "sarathi-256.json"))["config"]
    assert colocated["tensor_parallel_size"] == 4 and colocated["engine"] == "SimulatedEngine"
    # Each disaggregated run's KV transfers: a `transfer` line, the run's JSON, the receiving instances' records.
    out = capsys.readouterr().out
    assert "[sarathi-256+pd2:2] transfer: " in out and "[sarathi-256+pd1:3/1] transfer: " in out
    assert "[sarathi-256] transfer" not in out and "the link model's time" in out
    transfer = doc["transfer"]
    assert transfer["num_transfers"] >= 30 and transfer["bytes"] > 0 and transfer["seconds"] > 0
    rows = list(csv.DictReader(open(tmp_path / "sarathi-256_pd1_3_1_iterations.csv")))
    assert sum(int(r["transfer_bytes"]) for r in rows) == transfer["bytes"]
    assert all(r["instance"].startswith("decode") for r in rows if int(r["transfer_bytes"]))


def test_real_engine_tiny_model(tmp_path, capsys):
    # The smallest real run: tiny-llama (random weights), two compiled buckets (16, 32), four short requests.
    rc = main(["--model", "tiny-llama", "--scheduler", "sarathi", "--token-budget", "32", "--max-num-seqs", "4",
               "--max-model-len", "64", "--num-blocks", "32", "--num-requests", "4", "--qps", "20",
               "--prompt-len", "uniform:8:40", "--output-len", "4", "--out", str(tmp_path), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    summary = check_outputs(tmp_path, ["sarathi-32"])
    assert summary[0]["num_completed"] == "4"
    doc = json.load(open(tmp_path / "sarathi-32.json"))
    assert doc["config"]["engine"] == "LLMEngine"
    assert all(r["num_output_tokens"] == 4 and r["finish_reason"] == "length" for r in doc["requests"])
    assert all(len(r["token_times"]) == 4 and r["ttft"] > 0 for r in doc["requests"])


def test_simulate_shared_prefix_with_and_without_prefix_caching(tmp_path, capsys):
    rc = main(["--simulate", "--scheduler", "sarathi", "--token-budget", "256", "--num-requests", "30",
               "--qps", "4", "--prompt-len", "uniform:16:64", "--output-len", "uniform:8:32",
               "--shared-prefix-len", "512", "--multi-turn", "2", "--prefix-caching", "off,on",
               "--out", str(tmp_path), "--quiet", "--no-plots"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "prefix hit" in out and "512-token shared prefix" in out
    summary = {r["run"]: r for r in csv.DictReader(open(tmp_path / "summary.csv"))}
    off, on = summary["sarathi-256"], summary["sarathi-256+prefix"]
    assert off["prefix_cache_hit_rate"] == "" and float(on["prefix_cache_hit_rate"]) > 0.5
    assert int(on["num_prefill_tokens"]) < int(off["num_prefill_tokens"]) / 2
    assert float(on["ttft_p50"]) < float(off["ttft_p50"])


def test_text_prompts_file_prints_first_completion(hf_checkpoint, tmp_path, capsys):
    """`--prompts-file` with a tokenizer model: the requests are the file's lines (cycled), they stop at EOS,
    and the first completion printed is what `LLM.generate` gives for the same line."""
    from sarathi_jax import LLM, SamplingParams

    model = str(hf_checkpoint("llama"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\n\nHello world! How are you today?\n")
    rc = main(["--model", model, "--scheduler", "sarathi", "--token-budget", "32", "--max-num-seqs", "4",
               "--max-model-len", "64", "--num-blocks", "32", "--num-requests", "3", "--offline",
               "--output-len", "12", "--prompts-file", str(prompts), "--out", str(tmp_path / "out"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.load(open(tmp_path / "out" / "sarathi-32.json"))
    llm = LLM(model, token_budget=32, max_num_seqs=4, max_model_len=64, num_blocks=32)
    expected = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert f"[sarathi-32] first completion: {expected.text!r}" in out
    ids = llm.engine.admission.prompt_ids
    assert [r["prompt_len"] for r in doc["requests"]] == [len(ids("The quick brown fox")),
                                                          len(ids("Hello world! How are you today?")),
                                                          len(ids("The quick brown fox"))]
    assert doc["requests"][0]["num_output_tokens"] == len(expected.token_ids)
